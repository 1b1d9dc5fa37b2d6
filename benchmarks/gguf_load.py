"""Cold load of a GGUF file to its first token, ours (blocks run natively) against llama.cpp (llama-cpp-python),
with peak RSS, and how much of our load is the work a pack cache could keep: the copies that fuse q/k/v and
gate/up blocks (llama/formats/gguf_quants.py finish; nothing else is repacked, the other blocks are the file's
mapped pages).

    python benchmarks/gguf_load.py FILE.gguf [FILE.gguf ...] [--rounds 2] [--threads 2] [--warm]

Each case is a fresh process: the file is dropped from the page cache (posix_fadvise DONTNEED; --warm keeps it),
then the engine loads it and runs a 16-token prompt (the first token). Rounds alternate the engines' order.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from harness import drop_from_page_cache, peak_rss

PROMPT = [1, 415, 5565, 302, 4843, 349, 5465, 28723, 415, 5565, 302, 7293, 349, 8430, 28723, 415]


def ours(path: str, threads: int) -> dict:
    import torch

    from llama import Llama
    from llama.formats import gguf_quants

    torch.set_num_threads(threads)
    spent = {"fuse_s": 0.0}
    finish = gguf_quants.finish

    def timed(*a, **k):
        t = time.perf_counter()
        finish(*a, **k)
        spent["fuse_s"] += time.perf_counter() - t

    gguf_quants.finish = timed
    start = time.perf_counter()
    g = Llama.build(path, None, max_seq_len=64, max_batch_size=1, dtype="bfloat16", compile=False)
    built = time.perf_counter()
    with g.cache.hold():
        g.runner.logits([PROMPT[: 16]])
    return {"build_s": built - start, "first_token_s": time.perf_counter() - start, "fuse_s": spent["fuse_s"],
            "kinds": gguf_quants.summary(g.model)}


def peer(path: str, threads: int) -> dict:
    import llama_cpp

    start = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=64, n_batch=16, n_threads=threads, verbose=False)
    built = time.perf_counter()
    llm.eval(PROMPT[:16])
    return {"build_s": built - start, "first_token_s": time.perf_counter() - start}


def child(path: str, engine: str, threads: int, warm: bool) -> dict:
    if not warm:
        drop_from_page_cache([path])
    out = ours(path, threads) if engine == "ours" else peer(path, threads)
    return {**out, "peak_rss_gb": peak_rss() / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warm", action="store_true", help="keep the file in the page cache")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child[0], a.child[1], a.threads, a.warm)))
        return
    print(f"{'warm' if a.warm else 'cold'} page cache, {a.threads} threads, {a.rounds} rounds\n")
    print("| file | size GB | round | engine | load s | first token s | of which fusing s | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for f in a.files:
        size = Path(f).stat().st_size / 1e9
        for r in range(a.rounds):
            for engine in (("ours", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "ours")):
                cmd = [sys.executable, __file__, "--child", f, engine, "--threads", str(a.threads),
                       *(["--warm"] if a.warm else [])]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    raise RuntimeError(proc.stderr[-3000:])
                m = json.loads(line[len("RESULT "):])
                rows.append({"file": Path(f).name, "round": r + 1, "engine": engine, **m})
                print(f"| {Path(f).name} | {size:.2f} | {r + 1} | {engine} | {m['build_s']:.2f} | "
                      f"{m['first_token_s']:.2f} | {m.get('fuse_s', 0):.2f} | {m['peak_rss_gb']:.2f} |", flush=True)
    print("JSON " + json.dumps(rows))


if __name__ == "__main__":
    main()
