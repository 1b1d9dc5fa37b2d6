"""int8 keys and values against the model's cache, paired per token (`python -m benchmarks prefix-cache
int8-kv-paired`): every window of the text runs with the model's cache and with each way of storing keys and values,
one after the other, so each scored token's log-likelihood difference and KL divergence are taken against the same
token's reference. A perplexity difference alone hides its noise: this prints its standard error, and a noise floor,
the same passes with keys and values perturbed 250x less than int8 does (16-bit codes), which is what the model's
own rounding (bf16 activations, GGUF activation codes) amplifies any change into.

The stored forms are applied in the cache write (llama/kernels/paged.py write) of a cache in the model's dtype:
dequantize(quantize(x)) rounded to that dtype, what an int8 pool's read gives its attention.
"""

import math
import time
from pathlib import Path

import torch

from benchmarks.harness import print_results

BF16 = "bf16 keys and values"
CORPUS = Path(__file__).resolve().parents[1] / "llama" / "data" / "demo_corpus.txt"


def per_group(x: torch.Tensor, group: int, levels: float, scale_dtype=torch.float32) -> torch.Tensor:
    """x through symmetric codes of `levels` per group of `group` values (scale amax / levels in scale_dtype)."""
    g = x.float().unflatten(-1, (-1, group))
    s = (g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / levels).to(scale_dtype).float()
    return (torch.round(g / s).clamp(-levels, levels) * s).flatten(-2)


def forms():
    from llama.kernels import paged

    return {
        BF16: lambda x: x.to(torch.bfloat16).float(),
        "16-bit codes per head (noise floor)": lambda x: per_group(x, x.shape[-1], 32767.0),
        "int8 + fp32 scale per head (before)": lambda x: per_group(x, x.shape[-1], 127.0),
        "int8 q8_0: fp16 scale per 32 (now)": lambda x: paged.dequantize(*paged.quantize(x), torch.float32),
    }


def run(args) -> None:
    from llama import Llama
    from llama.cli.perplexity import windows
    from llama.kernels import paged

    gen = Llama.build(args.model, None, max_seq_len=args.window, max_batch_size=1, dtype=args.dtype, compile=False,
                      prefix_cache="off")
    text = Path(args.text).read_text() if args.text else CORPUS.read_text()
    toks = gen.tokenizer.encode(text, bos=False, eos=False)[: args.tokens]
    variants = forms()
    write, current, err = paged.write, [None], {n: [0.0, 0.0] for n in variants}

    def stored(cache, blocks, offsets, x):
        f = variants.get(current[0])
        if f is None or cache.dtype == torch.int8:
            return write(cache, blocks, offsets, x)
        y = f(x)
        err[current[0]][0] += float(((y - x.float()) ** 2).sum())
        err[current[0]][1] += float((x.float() ** 2).sum())
        cache[blocks, :, offsets] = y.to(cache.dtype)

    def logprobs(ids, form):
        current[0] = form
        with gen.cache.hold():
            return gen.runner.logits([ids])[0].float().log_softmax(-1)

    paged.write = stored
    diffs = {n: ([], []) for n in variants}
    ref_nll, spans, start = [], windows(len(toks), args.window, args.stride), time.perf_counter()
    try:
        for i, (b, e, first) in enumerate(spans):
            ids = [gen.tokenizer.bos_id] + toks[b:e]
            target = torch.tensor(toks[first:e])[:, None]
            ref = logprobs(ids, None)[first - b : e - b]
            ref_nll.append(-ref.gather(1, target)[:, 0])
            for name in variants:
                got = logprobs(ids, name)[first - b : e - b]
                diffs[name][0].append(ref.gather(1, target)[:, 0] - got.gather(1, target)[:, 0])
                diffs[name][1].append((ref.exp() * (ref - got)).sum(-1))
            print(f"window {i + 1}/{len(spans)}, {time.perf_counter() - start:.0f} s", flush=True)
    finally:
        paged.write = write
    nll = torch.cat(ref_nll)
    ppl = math.exp(float(nll.mean()))
    rows = [{"keys and values": args.dtype, "perplexity": round(ppl, 4)}]
    for name in variants:
        d, kld = torch.cat(diffs[name][0]), torch.cat(diffs[name][1])
        se = float(d.std()) / math.sqrt(len(d))
        rows.append({"keys and values": name, "perplexity": round(ppl * math.exp(float(d.mean())), 4),
                     "delta": round(ppl * math.expm1(float(d.mean())), 4), "delta's standard error": round(ppl * se, 4),
                     "mean KL divergence": round(float(kld.mean()), 6),
                     "key/value relative RMS error": round(math.sqrt(err[name][0] / err[name][1]), 5)})
    if args.dtype in ("fp32", "float32"):  # each form against the bf16 cache, paired per token
        base = torch.cat(diffs[BF16][0])
        for name in variants:
            if name != BF16:
                d = torch.cat(diffs[name][0]) - base
                rows.append({"keys and values": f"{name}, against bf16 keys and values",
                             "delta": round(ppl * math.expm1(float(d.mean())), 4),
                             "delta's standard error": round(ppl * float(d.std()) / math.sqrt(len(d)), 4)})
    print(f"{args.model} ({args.dtype}), {len(nll)} tokens of {args.text or CORPUS.name}, windows of {args.window} "
          f"stride {args.stride}: paired against the {args.dtype} cache")
    print_results("int8-kv-paired", rows)


def add_parser(sub) -> None:
    p = sub.add_parser("int8-kv-paired")
    p.add_argument("--model", required=True, help="a Meta checkpoint directory or a GGUF file")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--text", default=None, help="a text file (default llama/data/demo_corpus.txt)")
    p.add_argument("--tokens", type=int, default=None, help="score only the text's first N tokens")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--stride", type=int, default=128)
