"""Perplexity of a text file over sliding windows.

    python -m llama.perplexity --ckpt_dir DIR [--tokenizer_path T] FILE [--max_seq_len 512] [--stride N]
        [--max_batch_size 4]

A text longer than the context is cut into windows of max_seq_len positions (BOS + max_seq_len - 1 text tokens)
that start `stride` tokens apart. Each token is scored exactly once, in the first window where it is not among
the tokens an earlier window already scored, so every token after the first window has at least
max_seq_len - 1 - stride tokens of context. A smaller stride gives more context per token and costs more
forward passes; stride = max_seq_len - 1 gives disjoint windows. Windows go through Llama.score, a batch of
them per forward pass. Every window starts with BOS, as every Llama training sequence does.
"""

import argparse
import math
import os
import sys
from typing import Dict, List, Optional

from llama.distributed import parallel
from llama.generation import Llama


def windows(n_tokens: int, window: int, stride: int) -> List[tuple]:
    """(begin, end, first_scored) for each window of text tokens [begin, end) scoring [first_scored, end)."""
    span = window - 1  # text tokens per window, after BOS
    if span < 1:
        raise ValueError(f"window (max_seq_len) must be at least 2 to score anything, got {window}")
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= span:
        raise ValueError(f"stride must be an integer in [1, {span}] (max_seq_len - 1), got {stride!r}")
    out, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + span, n_tokens)
        out.append((begin, end, prev_end))
        if end == n_tokens:
            return out
        prev_end, begin = end, begin + stride


def perplexity(generator, text: str, window: Optional[int] = None, stride: Optional[int] = None) -> Dict:
    """Perplexity of `text` under `generator` (a Llama), scoring every token once over sliding windows.

    window defaults to the generator's max_seq_len, stride to half a window. Returns tokens, windows,
    window, stride, nll (mean negative log-likelihood in nats) and perplexity.
    """
    window = generator.max_seq_len if window is None else window
    if isinstance(window, bool) or not isinstance(window, int) or not 2 <= window <= generator.max_seq_len:
        raise ValueError(f"window must be an integer in [2, max_seq_len={generator.max_seq_len}], got {window!r}")
    stride = max(1, (window - 1) // 2) if stride is None else stride
    tokens = generator.tokenizer.encode(text, bos=False, eos=False)
    if not tokens:
        raise ValueError("the text is empty: there is no token to score")
    spans = windows(len(tokens), window, stride)
    bos = generator.tokenizer.bos_id
    total, count = 0.0, 0
    step = generator.max_batch_size
    for i in range(0, len(spans), step):
        batch = spans[i : i + step]
        scores = generator.score([[bos] + tokens[b:e] for b, e, _ in batch])
        for (b, e, first), s in zip(batch, scores):
            lps = s["logprobs"][first - b :]  # logprobs[k] is token b + k's, given BOS and tokens b..b+k-1
            total += sum(lps)
            count += len(lps)
    assert count == len(tokens), (count, len(tokens))
    nll = -total / count
    return {"tokens": count, "windows": len(spans), "window": window, "stride": stride, "nll": nll,
            "perplexity": math.exp(nll)}


def default_tokenizer(ckpt_dir: str) -> str:
    """tokenizer.model inside the checkpoint directory, else beside it (Meta's download layout)."""
    for path in (os.path.join(ckpt_dir, "tokenizer.model"), os.path.join(os.path.dirname(os.path.abspath(ckpt_dir)), "tokenizer.model")):
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"no tokenizer.model in or beside {ckpt_dir}: pass --tokenizer_path")


def main(file: str, ckpt_dir: str, tokenizer_path: Optional[str] = None, max_seq_len: int = 512,
         stride: Optional[int] = None, max_batch_size: int = 4, pipeline_parallel_size: int = 1,
         kv_cache_dtype: Optional[str] = None, dtype: Optional[str] = None) -> Dict:
    """Load the model, score the file, print one summary line (rank 0) and return the figures."""
    with open(file, encoding="utf-8") as f:
        text = f.read()
    if tokenizer_path is None and not str(ckpt_dir).endswith(".gguf"):  # a GGUF file holds its tokenizer
        tokenizer_path = default_tokenizer(ckpt_dir)
    generator = Llama.build(ckpt_dir, tokenizer_path, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                            pipeline_parallel_size=pipeline_parallel_size, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    result = perplexity(generator, text, stride=stride)
    if parallel.is_main_process():
        print(f"{file}: {result['tokens']} tokens in {result['windows']} window(s) of {result['window']} "
              f"(stride {result['stride']}): perplexity {result['perplexity']:.4f}, "
              f"mean NLL {result['nll']:.4f} nats/token")
    return result


def cli(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m llama.perplexity", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="UTF-8 text file to score")
    p.add_argument("--ckpt_dir", required=True, help="Meta-layout checkpoint directory")
    p.add_argument("--tokenizer_path", default=None, help="sentencepiece model (default: in or beside ckpt_dir)")
    p.add_argument("--max_seq_len", type=int, default=512, help="window length in tokens, BOS included")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: half a window)")
    p.add_argument("--max_batch_size", type=int, default=4, help="windows per forward pass")
    p.add_argument("--pipeline_parallel_size", type=int, default=1, help="pipeline stages under torchrun")
    p.add_argument("--kv-cache-dtype", "--kv_cache_dtype", default=None, choices=["int8"], dest="kv_cache_dtype",
                   help="int8 keys/values: each head rotated, then q8_0 (default: the model's dtype)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the loader's choice)")
    a = p.parse_args(argv)
    try:
        main(a.file, a.ckpt_dir, a.tokenizer_path, a.max_seq_len, a.stride, a.max_batch_size, a.pipeline_parallel_size,
             a.kv_cache_dtype, a.dtype)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")

