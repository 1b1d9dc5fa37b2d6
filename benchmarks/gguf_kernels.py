"""GGUF block products (llama/kernels/csrc/gguf_blocks.cpp) per format on 7B-shaped layers: the AVX2 copy of the
inner loops against the AVX-512 VNNI copy, in one process, alternating rounds (LLAMA_CPU_AVX512, which the kernel
reads on every call), so the machine's drift falls on both.

    python -m benchmarks gguf-kernels [--formats Q4_0 Q8_0 ...] [--shapes 4096x4096 11008x4096] [--batch 1]
    python -m benchmarks gguf-kernels --decode FILE.gguf [--tokens 8] [--rounds 6]   # batch-1 decode of a file

Each round multiplies by enough distinct random-block matrices (tests/gguf_blocks_data.py) to total --stream-mb, so
the weights come from memory as in decoding, and reports ms per matrix; GB/s counts the weight bytes.
"""

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from harness import REPO, greedy_decoders, print_results, prompt_tokens

sys.path.insert(0, str(REPO / "tests"))

from gguf_blocks_data import random_blocks  # noqa: E402

from llama.kernels import cpu  # noqa: E402

FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q5_0", "IQ4_NL", "Q3_K", "Q2_K"]


def one_pass(x, weights, qtype) -> float:
    start = time.perf_counter()
    for w in weights:
        cpu.gguf_linear(x, w, qtype)
    return (time.perf_counter() - start) / len(weights)


def measure(kind: str, n: int, k: int, batch: int, rounds: int, stream_mb: int) -> dict:
    import gguf

    qtype = int(gguf.GGMLQuantizationType[kind])
    first = torch.from_numpy(random_blocks(kind, n, k, seed=0))
    copies = max(2, math.ceil(stream_mb * 2**20 / first.numel()))
    weights = [first] + [torch.from_numpy(random_blocks(kind, n, k, seed=i)) for i in range(1, copies)]
    x = torch.randn(batch, k)
    times = {"avx2": [], "avx512": []}
    for r in range(rounds):
        for path in (("avx2", "avx512") if r % 2 == 0 else ("avx512", "avx2")):
            os.environ["LLAMA_CPU_AVX512"] = "1" if path == "avx512" else "0"
            one_pass(x, weights[:2], qtype)  # warm the path's code
            times[path].append(one_pass(x, weights, qtype))
    os.environ.pop("LLAMA_CPU_AVX512", None)
    ratios = [a / b for a, b in zip(times["avx2"], times["avx512"])]
    ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
    return {"format": kind, "shape": f"{n}x{k}", "batch": batch, "MB": f"{first.numel() / 2**20:.1f}",
            "AVX2 ms": f"{ms['avx2']:.3f}", "AVX-512 ms": f"{ms['avx512']:.3f}",
            "AVX2 GB/s": f"{first.numel() / ms['avx2'] / 1e6:.1f}",
            "AVX-512 GB/s": f"{first.numel() / ms['avx512'] / 1e6:.1f}",
            "AVX2 / AVX-512 time, median": f"{statistics.median(ratios):.2f}x",
            "range": f"{min(ratios):.2f}–{max(ratios):.2f}x"}


def decode(path: str, tokens: int, rounds: int) -> dict:
    """Ours decoding a GGUF file at batch 1 (its blocks run natively), the two paths in alternating rounds."""
    from llama import Llama
    from llama.formats import gguf_quants

    gen = Llama.build(path, None, max_seq_len=64, max_batch_size=1, dtype="bfloat16", compile=False)
    gen.tokenizer.stop_tokens = {}
    run, _ = greedy_decoders(gen, None, prompt_tokens(gen.model.vocab_size, 16), tokens)
    rates = {"avx2": [], "avx512": []}
    for r in range(rounds):
        for path_ in (("avx2", "avx512") if r % 2 == 0 else ("avx512", "avx2")):
            os.environ["LLAMA_CPU_AVX512"] = "1" if path_ == "avx512" else "0"
            rates[path_].append(run())
    os.environ.pop("LLAMA_CPU_AVX512", None)
    ratios = [b / a for a, b in zip(rates["avx2"], rates["avx512"])]
    return {"file": Path(path).name, "kinds": str(gguf_quants.summary(gen.model)),
            "AVX2 tok/s": f"{statistics.median(rates['avx2']):.2f}",
            "AVX-512 tok/s": f"{statistics.median(rates['avx512']):.2f}",
            "AVX-512 / AVX2 rate, median": f"{statistics.median(ratios):.2f}x",
            "range": f"{min(ratios):.2f}–{max(ratios):.2f}x"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "11008x4096"], help="OUTxIN")
    ap.add_argument("--batch", nargs="+", type=int, default=[1])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--stream-mb", type=int, default=512, help="weight bytes per round (more than the caches)")
    ap.add_argument("--threads", type=int, help="torch's threads (default: its own choice)")
    ap.add_argument("--decode", metavar="FILE", help="time ours decoding this GGUF file instead")
    ap.add_argument("--tokens", type=int, default=8, help="--decode: tokens per round")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not cpu.available():
        sys.exit("our CPU kernels are not built here")
    if a.decode:
        row = decode(a.decode, a.tokens, a.rounds)
        print(" ".join(f"{key}={v}" for key, v in row.items()), flush=True)
        print_results("gguf-kernels", [row])
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, AVX-512 VNNI: "
          f"{ {'avx512f', 'avx512bw', 'avx512vl', 'avx512_vnni'} <= cpu.cpu_flags()}")
    rows = []
    for shape in a.shapes:
        n, k = map(int, shape.split("x"))
        for kind in a.formats:
            for b in a.batch:
                row = measure(kind, n, k, b, a.rounds, a.stream_mb)
                print(" ".join(f"{key}={v}" for key, v in row.items()), flush=True)
                rows.append(row)
    print_results("gguf-kernels", rows)


if __name__ == "__main__":
    main()
