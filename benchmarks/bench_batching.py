"""Continuous batching (the engine) against static batching (fixed sub-batches) on the same implementation.

The KV-cache/batching tutorial's workload: 32 requests, 8 slots, every 8th request wants 100 new tokens and the
others 10. Static batching runs each sub-batch of 8 until its 100-token member finishes; the engine refills a
slot as soon as a short request ends. EOS is banned by a logits processor so every request generates exactly its
length (random weights would otherwise stop anywhere), and decoding is greedy so both paths produce the same
tokens, which the benchmark checks.

    python benchmarks/bench_batching.py                      # random-weight dim-768 model + stories260K
    python benchmarks/bench_batching.py --models random --dim 512 --n_layers 8 --runs 5
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import STORIES, print_results, random_checkpoint

from llama import Llama

PROMPTS = ["Once upon a time", "Lily and her mom", "The little dog", "One day, Tom saw", "There was a big tree",
           "Sam liked to play", "The sun was hot", "A bird sat on"]


def workload(n_requests: int = 32, slots: int = 8, long: int = 100, short: int = 10):
    prompts = [PROMPTS[i % len(PROMPTS)] + ("," if i // len(PROMPTS) % 2 else "") for i in range(n_requests)]
    lengths = [long if i % slots == 0 else short for i in range(n_requests)]
    return prompts, lengths


MODES = ("static", "fifo", "longest_first")


def run(generator: Llama, prompts, lengths, mode: str):
    """(seconds, generated tokens, token ids per request) for one scheduling mode:
    static sub-batches; the engine fed online in arrival order (FIFO); offline text_completion, which admits the
    known workload longest first."""
    stops = list(generator.tokenizer.stop_tokens)

    def ban_eos(_tokens, logits):
        logits[stops] = float("-inf")
        return logits

    opts = dict(temperature=0.0, logprobs=True, logits_processors=ban_eos)
    b = generator.max_batch_size
    start = time.perf_counter()
    if mode == "longest_first":  # more prompts than slots: the decode core admits the longest first
        preds = generator.text_completion(prompts, max_gen_len=lengths, **opts)
    elif mode == "fifo":
        with generator.engine() as engine:
            handles = [engine.submit(p, max_gen_len=n, **opts) for p, n in zip(prompts, lengths)]
            preds = [h.result() for h in handles]
    else:  # static sub-batches: calls whose prompts all fit the cache
        preds = []
        for i in range(0, len(prompts), b):
            preds += generator.text_completion(prompts[i : i + b], max_gen_len=lengths[i : i + b], **opts)
    seconds = time.perf_counter() - start
    tokens = [p["tokens"] for p in preds]
    return seconds, sum(map(len, tokens)), tokens


def bench(name: str, ckpt_dir: Path, tokenizer: Path, runs: int, slots: int):
    generator = Llama.build(str(ckpt_dir), str(tokenizer), max_seq_len=256, max_batch_size=slots)
    prompts, lengths = workload(slots=slots)
    run(generator, prompts[:slots], lengths[:slots], "static")  # warm-up
    times = {mode: [] for mode in MODES}
    outputs = {}
    for _ in range(runs):  # interleaved, so machine noise hits every mode alike
        for mode in MODES:
            seconds, n_tokens, outputs[mode] = run(generator, prompts, lengths, mode)
            times[mode].append(seconds)
            if n_tokens != sum(lengths):
                raise RuntimeError(f"{name}: {mode} generated {n_tokens} tokens, expected {sum(lengths)}")
    if not outputs["static"] == outputs["fifo"] == outputs["longest_first"]:
        raise RuntimeError(f"{name}: continuous and static batching generated different tokens")
    best = {mode: min(t) for mode, t in times.items()}  # interference from other processes only adds time
    params = sum(p.numel() for p in generator.model.parameters())
    return {"model": name, "params": params, "tokens": sum(lengths), "best": best}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="random,stories260K", help="comma list of: random, stories260K")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--n_layers", type=int, default=12)
    ap.add_argument("--n_heads", type=int, default=12)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per mode (interleaved); the best is reported")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 by default: on a shared 2-core machine two threads oversubscribe the cores "
                         "and every operator slows down by an order of magnitude")
    args = ap.parse_args(argv)
    if not (STORIES / "tokenizer.model").is_file():
        sys.exit(f"stories260K not found at {STORIES}: the benchmark needs its tokenizer")
    torch.set_num_threads(args.threads)
    tokenizer = STORIES / "tokenizer.model"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            if model == "random":
                params = dict(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, multiple_of=256,
                              vocab_size=512)
                ckpt = random_checkpoint(Path(tmp) / "random", params)
                name = f"random dim {args.dim}, {args.n_layers} layers"
            elif model == "stories260K":
                ckpt, name = STORIES, "stories260K"
            else:
                sys.exit(f"unknown model {model!r}: use random or stories260K")
            results.append(bench(name, ckpt, tokenizer, args.runs, args.slots))
    print(f"\n32 requests, {args.slots} slots, every 8th wants 100 new tokens, the others 10; "
          f"torch threads {torch.get_num_threads()}; best of {args.runs} interleaved runs\n")
    heads = ["static batching", "continuous, FIFO (online submit)",
             "continuous, longest first (offline text_completion)"]
    rows = []
    for r in results:
        row = {"model": r["model"], "params": f"{r['params'] / 1e6:.2f}M"}
        for head, mode in zip(heads, MODES):
            sec = r["best"][mode]
            ratio = "" if mode == "static" else f", **{r['best']['static'] / sec:.2f}x**"
            row[head] = f"{sec:.2f} s, {r['tokens'] / sec:.0f} tok/s{ratio}"
        rows.append(row)
    print_results("batching", rows, extra={"results": results})
    return results


if __name__ == "__main__":
    main()
