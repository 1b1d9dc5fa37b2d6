"""Batch-1 decode of one GGUF file (Q4_K_M, Q8_0, ... as llama.cpp's quantizer writes them) by ours, running its
blocks natively (llama/formats/gguf_quants.py), and by llama.cpp, in one process, alternating blocks: ratios that the
machine's drift cancels.

    python -m benchmarks gguf-blocks FILE.gguf [FILE.gguf ...] [--blocks 6] [--tokens 8] [--quantize-from BF16.gguf]

--quantize-from makes each missing FILE with llama.cpp's quantizer (its type from the name: ...-Q4_K_M.gguf).
Both engines map the same file, so its pages are shared; ours adds its fused q/k/v and gate/up copies.
"""

import argparse
import ctypes
import statistics
import time
from pathlib import Path

from harness import child_main, greedy_decoders, print_results, prompt_tokens, run_child

HEAD = ["file", "ours tok/s, median", "llama.cpp tok/s, median", "ours / llama.cpp, median of blocks", "range",
        "load s (ours, warm cache)"]


def quantize(src: Path, out: Path) -> None:
    import llama_cpp

    ftype = out.stem.rsplit("-", 1)[-1].upper()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    tmp = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed on {src} -> {ftype}")
    tmp.rename(out)


def measure(cfg: dict) -> dict:
    """In a child process: both engines on the file, decoded in alternating blocks."""
    import llama_cpp
    import torch

    from llama import Llama
    from llama.formats import gguf_quants

    n, ctx = cfg["tokens"], 64
    start = time.perf_counter()
    ours = Llama.build(cfg["file"], None, max_seq_len=ctx, max_batch_size=1, dtype="bfloat16", compile=False)
    load = time.perf_counter() - start
    kinds = gguf_quants.summary(ours.model)
    ours.tokenizer.stop_tokens = {}
    peer = llama_cpp.Llama(cfg["file"], n_ctx=ctx, n_threads=torch.get_num_threads(), verbose=False)
    run_ours, run_peer = greedy_decoders(ours, peer, prompt_tokens(ours.model.vocab_size, 16), n)
    run_ours(), run_peer()
    blocks = []
    for b in range(cfg["blocks"]):
        pair = (("ours", run_ours), ("peer", run_peer))[:: 1 if b % 2 == 0 else -1]
        blocks.append({name: fn() for name, fn in pair})
    return {"blocks": blocks, "load": load, "kinds": kinds}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--quantize-from", help="a bf16 GGUF to make missing files from with llama.cpp's quantizer")
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if child_main(args.child, measure):
        return
    rows = []
    for f in args.files:
        path = Path(f)
        if not path.exists() and args.quantize_from:
            quantize(Path(args.quantize_from), path)
        cfg = {"file": str(path), "blocks": args.blocks, "tokens": args.tokens}
        res = run_child(__file__, cfg, *args.files[:1])
        if res is None:
            continue
        blocks = res["blocks"]
        ratios = [b["ours"] / b["peer"] for b in blocks]
        print(f"{path.name} {res['kinds']}: blocks (ours, llama.cpp tok/s): "
              + ", ".join(f"{b['ours']:.2f}/{b['peer']:.2f}" for b in blocks), flush=True)
        rows.append(dict(zip(HEAD, [path.name, f"{statistics.median(b['ours'] for b in blocks):.2f}",
                                    f"{statistics.median(b['peer'] for b in blocks):.2f}",
                                    f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}–{max(ratios):.2f}x",
                                    f"{res['load']:.1f}"])))
    print_results("gguf-blocks", rows, args.json)


if __name__ == "__main__":
    main()
