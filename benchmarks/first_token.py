"""Time to the first token from a fresh process, with the weights read at load (preload) or mapped lazily.

    python benchmarks/first_token.py CKPT_DIR [--tokenizer PATH] [--dtype bfloat16] [--rounds 2] [--cold]
                                     [--fill FILE]

Each case is a fresh process: Llama.build (preload=None, the default, or preload=False), then a 16-token prefill
(the first token's work) and 4 one-token decode steps. --cold first drops the checkpoint's files and the pack
caches from the page cache (posix_fadvise DONTNEED: pages no process maps), so the load or the first passes read
the disk. --fill reads another file (say another model's weights) twice into the page cache before each case,
so that the load competes with pages in use. Rounds alternate the two modes so that both meet the same machine; the table prints every round.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from harness import LLAMA2_TOKENIZER, drop_from_page_cache, peak_rss, print_results

MODES = {"preload": None, "lazy": False}
HEAD = ["round", "mode", "build s", "RSS after build GB", "16-token prefill s", "first token s", "decode step s",
        "peak RSS GB"]


def read_twice(path: str) -> None:
    for _ in range(2):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def measure(ckpt: str, tokenizer: str, dtype: str, mode: str, cold: bool, fill: str) -> dict:
    """In a child process: build, first prefill, then decode steps."""
    from llama import Llama
    from llama.settings import cache_dir

    if fill:
        read_twice(fill)
    if cold:
        drop_from_page_cache([*Path(ckpt).iterdir(), *(cache_dir() / "int4pack").glob("*.pt")])
    start = time.perf_counter()
    llm = Llama.build(ckpt, tokenizer, max_seq_len=32, max_batch_size=1, dtype=dtype, compile=False,
                      preload=MODES[mode])
    built = time.perf_counter()
    held = rss()
    x = torch.randint(0, llm.model.vocab_size, (1, 16))
    with torch.inference_mode():
        llm.model(x, 0)
        first = time.perf_counter()
        steps = []
        for i in range(4):
            t = time.perf_counter()
            llm.model(x[:, :1], 16 + i)
            steps.append(time.perf_counter() - t)
    return {"build_s": built - start, "prefill_s": first - built, "first_token_s": first - start,
            "step_s": statistics.median(steps), "built_rss_gb": held / 1e9, "rss_gb": peak_rss() / 1e9}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt")
    p.add_argument("--tokenizer", default=None, help="default: CKPT/tokenizer.model, else the shared Llama 2 one")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cold", action="store_true", help="drop the checkpoint from the page cache before each case")
    p.add_argument("--fill", default="", help="a file to read twice into the page cache before each case")
    p.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    tok = a.tokenizer or str(Path(a.ckpt) / "tokenizer.model")
    if not Path(tok).is_file():
        tok = str(LLAMA2_TOKENIZER)
    if a.measure:
        print("RESULT " + json.dumps(measure(a.ckpt, tok, a.dtype, a.measure[0], a.measure[1] == "cold", a.fill)))
        return
    print(f"{a.ckpt}, {a.dtype}, {'cold' if a.cold else 'warm'} page cache{', filled with ' + a.fill if a.fill else ''}, "
          f"{a.rounds} rounds")
    rows = []
    for r in range(a.rounds):
        for mode in (MODES if r % 2 == 0 else reversed(list(MODES))):
            cmd = [sys.executable, __file__, a.ckpt, "--tokenizer", tok, "--dtype", a.dtype,
                   "--measure", mode, "cold" if a.cold else "warm", "--fill", a.fill]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                failed = f"failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
                rows.append({**dict.fromkeys(HEAD, ""), "round": r + 1, "mode": mode, "build s": failed})
                continue
            m = json.loads(line[len("RESULT "):])
            rows.append(dict(zip(HEAD, [r + 1, mode, f"{m['build_s']:.1f}", f"{m['built_rss_gb']:.2f}",
                                        f"{m['prefill_s']:.2f}", f"{m['first_token_s']:.1f}", f"{m['step_s']:.2f}",
                                        f"{m['rss_gb']:.2f}"])))
            print(f"round {r + 1}, {mode}: {json.dumps(m)}", flush=True)
    print_results("first-token", rows)


if __name__ == "__main__":
    main()
