"""What the benchmarks share: paths, model shapes, weights prepared in a --workdir (random checkpoints through
llama.hub.demo), timing, alternating rounds, memory, a description of the machine, and the results table
(markdown and JSON). Every measurement module imports this one; `python -m benchmarks` runs them by name."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llama.hub.demo import write_random_checkpoint  # noqa: E402

SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"
LLAMA2_TOKENIZER = SHARED / "tokenizers" / "llama2" / "tokenizer.model"
LLAMA3_TOKENIZER = SHARED / "tokenizers" / "llama3" / "tokenizer.model"

# Named model shapes (vocab 32000: the Llama 2 tokenizer).
SHAPES = {
    "tiny": dict(dim=288, n_layers=6, n_heads=6, vocab_size=32000, multiple_of=256),  # stories15M's shape
    "110m": dict(dim=768, n_layers=12, n_heads=12, vocab_size=32000, multiple_of=256),  # 134M with the output
    "1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000, multiple_of=512,
               ffn_dim_multiplier=1.4),  # FFN 7680, 1.38B
    "7b": dict(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256),  # Llama 2 7B: 13.5 GB bf16
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------------------------- weights
def random_checkpoint(out_dir: Path, params: Dict, tokenizer: Optional[Path] = None, seed: int = 0,
                      dtype: torch.dtype = torch.float32, std: Optional[float] = None, shards: int = 1) -> Path:
    """Random Meta-layout weights of any shape (llama.hub.demo's writer), norm_eps defaulted; never in the repository."""
    return write_random_checkpoint(out_dir, {"norm_eps": 1e-5, **params}, tokenizer_path=tokenizer, seed=seed,
                                   dtype=dtype, std=std, shards=shards)


def shape_checkpoint(shape: str, out_dir: Path, seed: int = 0) -> Path:
    """A named shape in bf16 with std-0.02 weights (what bench.py and bench_compile_auto.py time)."""
    return random_checkpoint(out_dir, SHAPES[shape], seed=seed, dtype=torch.bfloat16, std=0.02)


def prompt_tokens(vocab: int, length: int, seed: int = 0) -> List[int]:
    """BOS and length - 1 random ids (no specials)."""
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, vocab, (length - 1,), generator=g).tolist()


def weight_bytes(model) -> int:
    """Bytes one decode step reads: every parameter but the embedding table (of which it reads B rows)."""
    named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n.endswith(".packed")]
    return sum(p.numel() * p.element_size() for n, p in named if not n.startswith("tok_embeddings"))


# --------------------------------------------------------------------------------------------- timing and memory
def best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def timed(fn):
    """(wall seconds, CPU seconds of this process, result). With one thread, CPU time is the work done,
    unaffected by other processes competing for the cores."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def best(fn, repeats: int):
    """(best wall time, best CPU time, last result) over repeats."""
    runs = [timed(fn) for _ in range(repeats)]
    return min(r[0] for r in runs), min(r[1] for r in runs), runs[-1][2]


def step_times(steps: Iterable) -> List[float]:
    """perf_counter() after each item of an iterator of decode steps, the start first."""
    times = [time.perf_counter()]
    for _ in steps:
        times.append(time.perf_counter())
    return times


def summarize(runs, batch: int) -> dict:
    """TTFT and decode tok/s from per-step timestamps of several runs: medians, robust to a busy machine.

    Step 1's interval is prefill + first sample (time to first token); later intervals are one decode step each.
    """
    ttft = statistics.median(t[1] - t[0] for t in runs)
    step = statistics.median(b - a for t in runs for a, b in zip(t[1:], t[2:]))
    return {"ttft_ms": ttft * 1e3, "decode_tps": batch / step}


def drop_from_page_cache(paths) -> None:
    """Evict files from the page cache (posix_fadvise DONTNEED; no root needed), so the next read meets the disk."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def weight_files(*dirs) -> List[Path]:
    """Every file under these directories and the pack caches of quantized checkpoints (llama/kernels/int4_pack_store.py)."""
    from llama.settings import cache_dir

    files = [f for d in dirs for f in Path(d).rglob("*") if f.is_file()]
    return files + sorted((cache_dir() / "int4pack").glob("*.pt"))


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def read_bandwidth(mb: int = 256, repeat: int = 10) -> float:
    """Streaming read GB/s: best of `repeat` sums over an mb-MB fp32 tensor, with torch's threads."""
    x = torch.ones(mb * 2**20 // 4)
    x.sum()
    return x.numel() * 4 / best_time(x.sum, repeat) / 1e9


def machine() -> str:
    cpu_name = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu_name} ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores, {mem:.0f} GiB RAM, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; {our_kernels()}")


def our_kernels() -> str:
    """Which of our CPU kernels run here: the results depend on it (llama/kernels/cpu.py)."""
    from llama.kernels import cpu
    if not cpu.available():
        return "our CPU kernels off (PyTorch's kernels)"
    caps = torch.cpu.get_capabilities()
    avx512 = os.environ.get("LLAMA_CPU_AVX512") != "0"
    vnni = avx512 and all(caps.get(f"avx512_{f}", False) for f in ("f", "bw", "dq", "vl", "vnni"))
    bf16 = avx512 and all(caps.get(f"avx512_{f}", False) for f in ("f", "bw", "vl", "bf16"))
    return (f"our CPU kernels on (int4/int8 tiles: {'AVX-512 VNNI' if vnni else 'AVX2'}; "
            f"bf16 tile: {'AVX-512 BF16' if bf16 else 'AVX2, in fp32'})")


def run_requests(llm, prompts: List[List[int]], params) -> List[float]:
    """Step timestamps of running token prompts through the decode core (one SamplingParams for all)."""
    reqs = llm.inputs.requests(prompts, [params] * len(prompts))
    with llm.cache.hold():
        return step_times(llm.core.run(reqs))


# --------------------------------------------------------------------------------------------- workdir and rounds

def decode_rate(times) -> float:
    """tok/s from step timestamps: the median decode step (the first interval is the prefill)."""
    return 1 / statistics.median(b - a for a, b in zip(times[2:], times[3:]))


def greedy_decoders(ours, peer, prompt: List[int], n: int):
    """(ours, llama.cpp's) batch-1 greedy decode of n tokens after prompt, each a call returning its tok/s: what
    the paired benchmarks alternate. ours: a Llama whose stop tokens are cleared; peer: a llama_cpp.Llama."""
    from llama.core.frontend.params import SamplingParams

    params = SamplingParams(temperature=0, max_gen_len=n)

    def run_ours():
        return decode_rate(run_requests(ours, [prompt], params))

    def run_peer():
        peer.reset()
        tokens = peer.generate(prompt, top_k=1, temp=0.0, reset=True)
        return decode_rate(step_times(next(tokens) for _ in range(n)))

    return run_ours, run_peer

def workdir(path: Optional[str], tmp: str) -> Path:
    """--workdir (made if missing; weights written there are reused by later runs naming it) or `tmp`."""
    d = Path(path) if path else Path(tmp)
    d.mkdir(parents=True, exist_ok=True)
    return d


def shape_or_dir(model: str, work: Path, seed: int = 0) -> Path:
    """A checkpoint directory as given, or a shape of SHAPES written once into `work`."""
    if model in SHAPES:
        return shape_checkpoint(model, work / model, seed)
    return Path(model)


def alternating(cases: List, rounds: int) -> Iterable:
    """(round, case) in the order ABC, CBA, ABC, ...: every case meets early and late parts of a drifting machine
    alike, so ratios between cases taken round by round cancel the drift."""
    for r in range(rounds):
        for case in (cases if r % 2 == 0 else cases[::-1]):
            yield r, case


def merge_rounds(rounds: list) -> dict:
    """One configuration's results over --rounds: the median of every figure, and each round's batch-1 decode
    rate kept (`b1_rounds`) so ratios can be taken round by round."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[0]
    out = dict(ok[0])
    for key, value in ok[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in ok if r.get(key) is not None)
        elif isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in ok if k in r.get(key, {})) for k in value}
    # None for a failed round, so that round_ratios pairs the same rounds of two configurations
    out["b1_rounds"] = [None if "error" in r else r["decode_tps"].get("1") for r in rounds]
    return out


def round_ratios(ours: dict, peer: dict) -> list:
    """Batch-1 decode ratios of two configurations, round by round (each pair ran minutes apart at most)."""
    return [a / b for a, b in zip(ours.get("b1_rounds", []), peer.get("b1_rounds", [])) if a and b]


# --------------------------------------------------------------------------------------------- results
def markdown_table(rows: List[Dict]) -> str:
    """Rows of one measurement as a markdown table, columns in the order the first row names them."""
    if not rows:
        return "(no results)"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


# Set by `python -m benchmarks NAME --json PATH` (__main__.py takes the option off the measurement's arguments):
# every results table of the run is appended to PATH, one JSON line each, as printed.
JSON_PATH: Optional[str] = None
_written: set = set()  # paths this process has begun writing: the first table of a run truncates, later ones append


def print_results(name: str, rows: List[Dict], json_path: Optional[str] = None, extra: Optional[Dict] = None) -> None:
    """The results table in markdown, then the same rows as one `JSON {...}` line (with the machine and date, and
    `extra`: raw figures the table condenses), also appended to json_path or JSON_PATH when set: what
    docs/performance.md quotes. A measurement with several tables calls this once per table, each named apart."""
    print(markdown_table(rows))
    record = {"benchmark": name, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "rows": rows, **(extra or {})}
    line = json.dumps(record)
    print("JSON " + line, flush=True)
    path = json_path or JSON_PATH
    if path:
        with open(path, "a" if path in _written else "w") as f:
            f.write(line + "\n")
        _written.add(path)


# ------------------------------------------------------------------------------------------------ child processes
# A measurement that must own its process (peak memory, thread settings, a fresh page cache) reruns its script with
# --child and prints one "RESULT <json>" line; the parent runs it and reads that line.
def child_main(argv_child: Optional[str], measure) -> bool:
    """In the child (argv_child: the --child JSON): print measure(config)'s RESULT line; False in the parent."""
    if argv_child is None:
        return False
    print("RESULT " + json.dumps(measure(json.loads(argv_child))), flush=True)
    return True


def run_child(script: str, config: dict, *args: str) -> Optional[dict]:
    """The RESULT of `python script *args --child config`, or None (its stderr printed) when it did not finish."""
    out = subprocess.run([sys.executable, script, *args, "--child", json.dumps(config)], capture_output=True,
                         text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(f"the measuring process failed (exit {out.returncode}):\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(line[len("RESULT "):])
