"""Speculative decoding with a compiled decode step (llama/core/worker/runner.py Runner._verify).

  python -m benchmarks.speculative_compiled cost [--dim 4096 --layers 8] [--quantize int8|int4] [--reps 5]
      c(k) = t(k+1-row Verify) / t(1-row Decode) for k = 1..8, eager and compiled (compile=True) on one model (a
      random bf16 checkpoint of that shape; the runner's compiled step is set aside for the eager timings), the
      variants alternated rep by rep and medians reported, so a busy machine slows both alike.
  python -m benchmarks.speculative_compiled divergence [--dtype bfloat16] [--quantize ...] [--prompts 40]
      greedy text of stories260K compiled, with and without speculation (prompt lookup, drafts decided by the
      tokens alone): tokens that differ per 10,000 and sequences that differ. Where a verify row is bitwise the
      one-token graph's (fp32 in our kernels) both are 0. For scale, the same for plain compiled decoding with the
      prompts 4 at a time against alone (what batching already changes). Run it with OMP_NUM_THREADS=1.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared/models/stories260K"
K = range(1, 9)


def cost(args) -> None:
    from benchmarks.speculative import random_llama, verify_ops

    heads = args.dim // 128  # Llama 2 7B's head_dim, no GQA
    g = random_llama(args.dim, args.layers, heads, heads, args.threads, compile=True, quantize=args.quantize)
    what = (f"dim {args.dim}, {args.layers} layers, {args.quantize or 'bf16'}, {torch.get_num_threads()} threads, "
            f"kernels outside the graph: {g.runner.compiled.outside}")
    compiled = g.runner.compiled
    with g.cache.hold():
        ops = verify_ops(g, K)
        for op in tqdm(ops.values(), desc="compiling"):  # first calls compile (or load) each graph
            g.runner.execute([op])
        times = {(v, k): [] for v in ("eager", "compiled") for k in ops}
        for _ in tqdm(range(args.reps), desc="reps"):
            for v in ("eager", "compiled"):
                g.runner.compiled = compiled if v == "compiled" else None
                for k, op in ops.items():
                    t = time.perf_counter()
                    g.runner.execute([op])
                    times[v, k].append(time.perf_counter() - t)
        g.runner.compiled = compiled
    med = {key: statistics.median(t) for key, t in times.items()}
    print(f"{what}: 1-token step eager {med['eager', 0] * 1e3:.1f} ms, compiled {med['compiled', 0] * 1e3:.1f} ms "
          f"(compiled/eager {med['compiled', 0] / med['eager', 0]:.2f}; medians of {args.reps})")
    print("k | c(k) eager | c(k) compiled | compiled/eager at k+1 rows")
    for k in K:
        print(f"{k} | {med['eager', k] / med['eager', 0]:.2f} | {med['compiled', k] / med['compiled', 0]:.2f} | "
              f"{med['compiled', k] / med['eager', k]:.2f}")


def divergence(args) -> None:
    from llama import Llama
    from llama.core.speculation import speculative

    speculative.MEASURE = False  # drafts by the tokens alone: the same run on any machine
    kw = dict(max_seq_len=256, max_batch_size=1, dtype=args.dtype, compile=True, quantize=args.quantize,
              prefix_cache="off")
    off = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), **kw)
    on = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), speculative="ngram", **kw)
    starts = ["Once upon a time", "Lily and Ben", "The cat", "One day, a little girl", "Tom had a big red ball.",
              "There was a dog named Max.", "The sun was shining.", "Mom said"]
    prompts = [f"{starts[i % len(starts)]} {' '.join(['and'] * (i // len(starts)))}".strip()
               for i in range(args.prompts)]
    alone = [off.generate([off.tokenizer.encode(p, bos=True, eos=False)], max_gen_len=args.tokens,
                          temperature=0)[0][0] for p in tqdm(prompts, desc="plain")]
    drafted = [on.generate([on.tokenizer.encode(p, bos=True, eos=False)], max_gen_len=args.tokens,
                           temperature=0)[0][0] for p in tqdm(prompts, desc="speculative")]
    report(f"stories260K {args.dtype} {args.quantize or ''} compiled (kernels outside the graph: "
           f"{on.runner.compiled.outside}), speculation on vs off", alone, drafted)
    print(f"graphs {sorted(on.runner.compiled.seen)}; acceptance by kind {on.core.drafting.rates}")
    del on
    # For scale: the same plain compiled decoding, prompts 4 at a time (the batch-4 graph) against alone.
    batched = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), **{**kw, "max_batch_size": 4})
    together = []
    for i in tqdm(range(0, len(prompts), 4), desc="batched"):
        enc = [batched.tokenizer.encode(p, bos=True, eos=False) for p in prompts[i:i + 4]]
        together += batched.generate(enc, max_gen_len=args.tokens, temperature=0)[0]
    report("plain compiled, batch of 4 vs alone", alone, together)


def report(what: str, a_runs, b_runs) -> None:
    tokens = differing = sequences = 0
    for a, b in zip(a_runs, b_runs):
        tokens += len(a)
        differing += sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
        sequences += a != b
    print(f"{what}: {tokens} greedy tokens, {differing} differing ({differing / max(tokens, 1) * 1e4:.1f} per "
          f"10,000), {sequences} of {len(a_runs)} sequences differing")


def main(argv=None) -> None:
    from llama.quantization import schemes
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--dim", type=int, default=4096)
    c.add_argument("--layers", type=int, default=8)
    c.add_argument("--quantize", default=None, choices=schemes.choices(),
                   help="a quantization scheme (default: bf16 weights)")
    c.add_argument("--reps", type=int, default=5)
    c.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    v = sub.add_parser("divergence")
    v.add_argument("--dtype", default="bfloat16")
    v.add_argument("--quantize", default=None, choices=schemes.choices())
    v.add_argument("--prompts", type=int, default=40)
    v.add_argument("--tokens", type=int, default=200)
    args = p.parse_args(argv)
    {"cost": cost, "divergence": divergence}[args.cmd](args)


if __name__ == "__main__":
    main()
