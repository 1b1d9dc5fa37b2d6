"""Mixture-of-experts at Qwen3-30B-A3B's shape (issue 51): ours against llama.cpp on the same random GGUF qwen3moe
file (moe_gguf.py), Q4_K_M and bf16, cut to its first layers so both engines fit in 24 GiB.

    python -m benchmarks moe [--schemes Q4_K_M BF16] [--layers 16] [--bf16-layers 4] [--workdir DIR] [--blocks 3]
                             [--tokens 8] [--batch 8] [--prompt 512] [--engines ours llamacpp] [--profile]

Per file: load time and peak RSS (a fresh process per engine, rounds alternating, page cache warm); then, in one
process holding both engines, alternating blocks (the machine's bandwidth flips between a fast and a slow state over
minutes, so ratios are taken block by block): batch-1 greedy decode, batch-8 decode (ours: 8 requests through the
engine; llama.cpp: 8 sequences in one llama_batch a step, llama-cpp-python's low-level API, greedy by argmax) and a
512-token prefill. Bytes a token reads come from the file's tensor sizes (every non-expert tensor, top_k/n_experts of
the experts at batch 1, the distinct experts of a step at batch 8), set against the read roofline of
../shared/tools/read_bandwidth.c. --profile times where our decode step goes, per layer: attention, router, grouping
(route, sort, scatter, combine) and expert products (hooks on the modules, batch 1 and 8).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import (child_main, decode_rate, greedy_decoders, machine, peak_rss, print_results, prompt_tokens,
                     run_child, run_requests, workdir)
from moe_gguf import bytes_per_token, expected_distinct, open_reader, write_moe_gguf

ENGINES = ("ours", "llamacpp")
SHARED = Path(__file__).resolve().parents[1].parent / "shared"


# --------------------------------------------------------------------------------------------- the engines
def build_ours(path: str, ctx: int, batch: int):
    from llama import Llama

    ours = Llama.build(path, None, max_seq_len=ctx, max_batch_size=batch, dtype="bfloat16", compile=False)
    ours.tokenizer.stop_tokens = {}
    return ours


def build_peer(path: str, ctx: int):
    import llama_cpp
    import torch

    threads = torch.get_num_threads()
    return llama_cpp.Llama(path, n_ctx=ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)


def peer_batched(peer, batch: int, ctx: int):
    """A call (prompts, n) -> step timestamps of llama.cpp decoding len(prompts) sequences together: the prompts
    prefilled in one llama_batch, then one llama_batch of a token per sequence a step, each greedy (argmax)."""
    import llama_cpp
    import numpy as np

    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max = batch * ctx, batch
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = peer.n_threads
    lctx = llama_cpp.llama_init_from_model(peer.model, params)
    if not lctx:
        raise RuntimeError("llama.cpp could not make a batched context")
    lbatch = llama_cpp.llama_batch_init(512, 0, batch)
    n_vocab = peer.n_vocab()

    def decode(items):
        lbatch.n_tokens = len(items)
        for j, (tok, pos, seq, out) in enumerate(items):
            lbatch.token[j], lbatch.pos[j], lbatch.n_seq_id[j] = tok, pos, 1
            lbatch.seq_id[j][0], lbatch.logits[j] = seq, out
        if llama_cpp.llama_decode(lctx, lbatch) != 0:
            raise RuntimeError("llama_decode failed on the batch")
        outs = [j for j, item in enumerate(items) if item[3]]
        return [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, j), shape=(n_vocab,)).argmax())
                for j in outs]

    def run(prompts, n):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(lctx), True)
        times = [time.perf_counter()]
        toks = decode([(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)])
        times.append(time.perf_counter())
        for step in range(n - 1):
            toks = decode([(tok, len(p) + step, s, True) for s, (tok, p) in enumerate(zip(toks, prompts))])
            times.append(time.perf_counter())
        return times

    return run


# --------------------------------------------------------------------------------------------- the measurements
def speed_cases(cfg: dict, ours, peer) -> dict:
    """{case: {engine: call returning tok/s}}: batch-1 decode, batch-B decode, prefill of P tokens."""
    from llama.core.frontend.params import SamplingParams

    n, B, P = cfg["tokens"], cfg["batch"], cfg["prompt"]
    seeds = iter(range(1, 1 << 30))  # a new prompt every time: no engine may reuse a cached prefix
    vocab = 151643  # the Qwen2 vocabulary's ordinary tokens
    cases = {"b1": {}, f"b{B}": {}, f"prefill{P}": {}}
    if ours is not None:
        run_b1, _ = greedy_decoders(ours, None, prompt_tokens(vocab, 16), n)
        cases["b1"]["ours"] = run_b1
        cases[f"b{B}"]["ours"] = lambda: B * decode_rate(run_requests(
            ours, [prompt_tokens(vocab, 16, next(seeds)) for _ in range(B)],
            SamplingParams(temperature=0, max_gen_len=n)))

        def prefill_ours():
            times = run_requests(ours, [prompt_tokens(vocab, P, next(seeds))], SamplingParams(temperature=0,
                                                                                              max_gen_len=1))
            return P / (times[1] - times[0])
        cases[f"prefill{P}"]["ours"] = prefill_ours
    if peer is not None:
        _, run_b1 = greedy_decoders(None, peer, prompt_tokens(vocab, 16), n)
        cases["b1"]["llamacpp"] = run_b1
        batched = peer_batched(peer, B, 16 + n + 8)
        cases[f"b{B}"]["llamacpp"] = lambda: B * decode_rate(batched(
            [prompt_tokens(vocab, 16, next(seeds)) for _ in range(B)], n))

        def prefill_peer():
            prompt = prompt_tokens(vocab, P, next(seeds))
            peer.reset()
            start = time.perf_counter()
            peer.eval(prompt)
            return P / (time.perf_counter() - start)
        cases[f"prefill{P}"]["llamacpp"] = prefill_peer
    return cases


def measure_speed(cfg: dict) -> dict:
    """In a child process: the engines on the file, every case in alternating blocks."""
    ctx = max(cfg["prompt"], 16 + cfg["tokens"]) + 16
    ours = build_ours(cfg["file"], ctx, cfg["batch"]) if "ours" in cfg["engines"] else None
    peer = build_peer(cfg["file"], ctx) if "llamacpp" in cfg["engines"] else None
    cases = speed_cases(cfg, ours, peer)
    for engines in cases.values():  # warm every path once
        for fn in engines.values():
            fn()
    blocks = []
    for b in range(cfg["blocks"]):
        block = {}
        for case, engines in cases.items():
            order = list(engines.items())[:: 1 if b % 2 == 0 else -1]
            block[case] = {name: fn() for name, fn in order}
            print(f"block {b} {case}: " + ", ".join(f"{k} {v:.2f} tok/s" for k, v in block[case].items()),
                  file=sys.stderr, flush=True)
        blocks.append(block)
    return {"blocks": blocks}


def measure_load(cfg: dict) -> dict:
    """In a fresh child process: one engine's load to its first token of a 16-token prompt, and peak RSS."""
    prompt = prompt_tokens(151643, 16)
    start = time.perf_counter()
    if cfg["engine"] == "ours":
        ours = build_ours(cfg["file"], 64, 1)
        built = time.perf_counter()
        with ours.cache.hold():
            ours.runner.logits([prompt])
    else:
        peer = build_peer(cfg["file"], 64)
        built = time.perf_counter()
        peer.eval(prompt)
    return {"load_s": built - start, "first_token_s": time.perf_counter() - start, "peak_rss_gb": peak_rss() / 1e9}


def run_child_live(config: dict):
    """harness.run_child with the child's stderr (its per-block progress) passed through as it runs."""
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(config)], stdout=subprocess.PIPE, text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(f"the measuring process failed (exit {out.returncode})", file=sys.stderr)
        return None
    return json.loads(line[len("RESULT "):])


def measure(cfg: dict) -> dict:
    from moe_profile import measure_profile

    return {"speed": measure_speed, "load": measure_load, "profile": measure_profile}[cfg["mode"]](cfg)


# --------------------------------------------------------------------------------------------- bytes and roofline
def read_roofline(work: Path, threads: int) -> float:
    """Best read GB/s of ../shared/tools/read_bandwidth.c (its 512-bit loads made 256-bit where the CPU lacks
    AVX-512: every cache line is still read), built once into the workdir."""
    src = (SHARED / "tools" / "read_bandwidth.c").read_text()
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        src = re.sub(r"_mm512_load_si512\(([^)]*)\)", r"_mm256_load_si256((const __m256i *)(\1))", src)
        src = (src.replace("__m512i", "__m256i").replace("_mm512_setzero_si512", "_mm256_setzero_si256")
               .replace("_mm512_add_epi64", "_mm256_add_epi64")
               .replace("_mm512_storeu_si512(s,", "_mm256_storeu_si256((__m256i *)s,").replace("AVX-512", "AVX2"))
    exe = work / "read_bandwidth"
    if not exe.exists():
        (work / "read_bandwidth.c").write_text(src)
        subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", str(work / "read_bandwidth.c"), "-o", str(exe)],
                       check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    return float(out.split("best")[1].split("GB/s")[0])


# --------------------------------------------------------------------------------------------- the run
def file_for(args, scheme: str) -> Path:
    layers = args.layers if scheme == "Q4_K_M" else args.bf16_layers
    work = workdir(args.workdir, "/tmp/moe-bench")
    return write_moe_gguf(work / f"qwen3-30b-a3b-shape-{layers}of48-{scheme}.gguf", scheme, layers)


def load_rows(path: Path, args) -> list:
    """Load time, first token and peak RSS of each engine, a fresh process each, rounds alternating."""
    runs = {e: [] for e in args.engines}
    for r in range(args.load_rounds):
        for engine in args.engines[:: 1 if r % 2 == 0 else -1]:
            res = run_child(__file__, {"mode": "load", "file": str(path), "engine": engine})
            if res is not None:
                runs[engine].append(res)
    rows = []
    for engine, got in runs.items():
        if got:
            rows.append({"file": path.name, "engine": engine, "size GB": round(path.stat().st_size / 1e9, 2),
                         **{k: round(statistics.median(g[k] for g in got), 2) for k in got[0]}})
    return rows


def speed_rows(path: Path, args, roofline: float) -> list:
    cfg = {"mode": "speed", "file": str(path), "engines": args.engines, "blocks": args.blocks,
           "tokens": args.tokens, "batch": args.batch, "prompt": args.prompt}
    res = run_child_live(cfg)
    if res is None:
        return []
    reader = open_reader(path)
    one, many = bytes_per_token(reader), bytes_per_token(reader, expected_distinct(args.batch))
    rows = []
    for case in res["blocks"][0]:
        got = {e: [b[case][e] for b in res["blocks"]] for e in res["blocks"][0][case]}
        row = {"file": path.name, "case": case}
        for e, v in got.items():
            row[f"{e} tok/s"] = round(statistics.median(v), 2)
        if len(got) == 2:
            ratios = [a / b for a, b in zip(got["ours"], got["llamacpp"])]
            row["ours / llama.cpp"] = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}–{max(ratios):.2f})"
        if not case.startswith("prefill"):
            gb = one["read_gb"] if case == "b1" else many["read_gb"] / args.batch
            for e, v in got.items():
                row[f"{e} roofline share"] = f"{100 * gb * statistics.median(v) / roofline:.0f} %"
        rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", nargs="+", default=["Q4_K_M", "BF16"], choices=["Q4_K_M", "BF16"])
    p.add_argument("--layers", type=int, default=16, help="layers of the Q4_K_M file (of 48)")
    p.add_argument("--bf16-layers", type=int, default=4, help="layers of the bf16 file (of 48)")
    p.add_argument("--workdir", help="where the files go (made once, reused; default /tmp/moe-bench)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8, help="tokens a decode run generates")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512, help="prefill length")
    p.add_argument("--load-rounds", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="also time our decode step's parts per layer")
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if child_main(args.child, measure):
        return
    import torch

    work = workdir(args.workdir, "/tmp/moe-bench")
    roofline = read_roofline(work, torch.get_num_threads())
    print(f"{machine()}\nread roofline (read_bandwidth.c, {torch.get_num_threads()} threads): {roofline:.1f} GB/s",
          flush=True)
    for scheme in args.schemes:
        path = file_for(args, scheme)
        reader = open_reader(path)
        one, many = bytes_per_token(reader), bytes_per_token(reader, expected_distinct(args.batch))
        print(f"{path.name}: a batch-1 token reads {one['read_gb'] * 1e3:.0f} MB ({one['params_b']:.2f} B active "
              f"parameters); a batch-{args.batch} step {many['read_gb'] * 1e3:.0f} MB "
              f"({expected_distinct(args.batch):.1f} distinct experts a layer if routed uniformly)", flush=True)
        print_results("moe-load", load_rows(path, args), args.json)
        print_results("moe-speed", speed_rows(path, args, roofline), args.json,
                      extra={"roofline_gbs": roofline, "bytes": {"b1": one, f"b{args.batch}": many}})
        if args.profile and "ours" in args.engines:
            res = run_child_live({"mode": "profile", "file": str(path), "batch": args.batch,
                                  "tokens": args.tokens})
            if res is not None:
                print_results("moe-profile", res["rows"], args.json, extra={"distinct": res["distinct"]})


if __name__ == "__main__":
    main()
