"""Convert other checkpoint formats into the Meta layout this package loads.

    python -m llama.convert llama2c MODEL.bin OUT_DIR [--tokenizer tok.model] [--shards N]
    python -m llama.convert hf HF_DIR OUT_DIR [--shards N] [--dtype bfloat16]

llama2.c files (Karpathy's tinyllamas and its export.py: legacy v0 header or the v1 "ak42" header) hold fp32
weights with the same rotary convention as Meta's, so values are copied unchanged. Hugging Face directories of the
LLaMA-style families (Llama, Mistral, Qwen2, Phi-3, Granite) are read by llama/formats/hf_checkpoint.py, which
undoes their rotate-half q/k row order; they also load directly with Llama.build(HF_DIR, None).
"""

import argparse
import dataclasses
import math
import mmap
import struct
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from llama.formats import gguf_file
from llama.formats import hf_checkpoint
from llama.formats.hf_checkpoint import read_safetensors  # noqa: F401 (tests and tools import it from here)
from llama.formats.meta_checkpoint import save_checkpoint
from llama.model import ModelArgs, derive_ffn

LLAMA2C_MAGIC = 0x616B3432  # "ak42"


def meta_params(args: ModelArgs) -> dict:
    """params.json as Meta writes it: optional keys only when they differ from the defaults."""
    p = {"dim": args.dim, "multiple_of": args.multiple_of, "n_heads": args.n_heads, "n_layers": args.n_layers,
         "norm_eps": args.norm_eps, "vocab_size": args.vocab_size}
    if args.n_kv_heads != args.n_heads:
        p["n_kv_heads"] = args.n_kv_heads
    if args.ffn_dim_multiplier is not None:
        p["ffn_dim_multiplier"] = args.ffn_dim_multiplier
    if args.rope_theta != 10000.0:
        p["rope_theta"] = args.rope_theta
    defaults = ModelArgs(dim=args.dim, n_heads=args.n_heads, multiple_of=args.multiple_of,
                         ffn_dim_multiplier=args.ffn_dim_multiplier)
    for name in ("head_dim", "hidden_dim", "qkv_bias", "sliding_window", "rope_scaling", "embedding_multiplier",
                 "residual_multiplier", "attention_multiplier", "logits_scaling", "qk_norm"):
        if getattr(args, name) != getattr(defaults, name):
            p[name] = getattr(args, name)
    if args.moe is not None:  # MoEArgs as a dict (its dense_layers a list)
        p["moe"] = {**dataclasses.asdict(args.moe), "dense_layers": list(args.moe.dense_layers)}
    if args.use_scaled_rope:
        p["use_scaled_rope"] = True
        defaults = ModelArgs()
        for name in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context"):
            if getattr(args, name) != getattr(defaults, name):
                p[name] = getattr(args, name)
    return p


def _map_file(path: Path) -> mmap.mmap:
    """A private (copy-on-write) map of the file: tensors are views on it, nothing is read until used."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise ValueError(f"{path} is empty")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


# ---------------------------------------------------------------------------------------------------------------
# llama2.c


def read_llama2c(path) -> Tuple[ModelArgs, Dict[str, torch.Tensor], int]:
    """(args, Meta-named state dict, seq_len) of a llama2.c checkpoint (v0 or v1 header, fp32)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"llama2.c checkpoint {path} not found")
    buf = _map_file(path)
    size = len(buf)
    if size >= 8 and struct.unpack_from("<I", buf, 0)[0] == LLAMA2C_MAGIC:
        version = struct.unpack_from("<i", buf, 4)[0]
        if version != 1:
            what = "int8 Q8_0-quantised" if version == 2 else "unknown"
            raise ValueError(
                f"{path} is a llama2.c version {version} file ({what}); only fp32 versions 0 and 1 are supported: "
                "re-export it with `export.py --version 1`"
            )
        if size < 256:
            raise ValueError(f"{path} is truncated: {size} bytes, shorter than the 256-byte v1 header")
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack_from("<7i", buf, 8)
        shared = bool(buf[36])
        offset = 256
    else:
        if size < 28:
            raise ValueError(f"{path} is too short ({size} bytes) to be a llama2.c checkpoint")
        dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack_from("<7i", buf, 0)
        shared, vocab = vocab > 0, abs(vocab)  # legacy: a negative vocab_size means an unshared classifier
        offset, version = 28, 0
    header = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
                  vocab_size=vocab, seq_len=seq_len)
    bad = [k for k, v in header.items() if not 0 < v < 1 << 24]
    if bad or dim % n_heads or n_heads % n_kv:
        raise ValueError(f"{path} does not have a valid llama2.c header (read {header})")
    multiple_of, mult = derive_ffn(dim, hidden)
    args = ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, vocab_size=vocab,
                     multiple_of=multiple_of, ffn_dim_multiplier=mult, norm_eps=1e-5)
    L, kv_dim, hd = n_layers, n_kv * (dim // n_heads), dim // n_heads
    layered = {
        "attention_norm": (L, dim), "ffn_norm": (L, dim), "wq": (L, dim, dim), "wk": (L, kv_dim, dim),
        "wv": (L, kv_dim, dim), "wo": (L, dim, dim), "w1": (L, hidden, dim), "w2": (L, dim, hidden),
        "w3": (L, hidden, dim),
    }
    plain = {"tok_embeddings": (vocab, dim), "norm": (dim,), "freqs": (2, seq_len, hd // 2), "output": (vocab, dim)}
    shapes = {**plain, **layered}
    if version == 0:  # llama2.c's legacy_export order
        order = ["tok_embeddings", "attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3", "norm",
                 "freqs"]
    else:  # version1_export order
        order = ["attention_norm", "ffn_norm", "norm", "tok_embeddings", "wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    if not shared:
        order.append("output")
    want = offset + 4 * sum(math.prod(shapes[n]) for n in order)
    if size != want:
        raise ValueError(
            f"{path} has {size} bytes but its header (v{version}, {header}, shared classifier {shared}) implies "
            f"{want}: the file is truncated or not a llama2.c fp32 checkpoint"
        )
    raw = {}
    for name in order:
        n = math.prod(shapes[name])
        raw[name] = torch.frombuffer(buf, dtype=torch.float32, count=n, offset=offset).view(shapes[name])
        offset += 4 * n
    names = {"attention_norm": "attention_norm", "ffn_norm": "ffn_norm", "wq": "attention.wq", "wk": "attention.wk",
             "wv": "attention.wv", "wo": "attention.wo", "w1": "feed_forward.w1", "w2": "feed_forward.w2",
             "w3": "feed_forward.w3"}
    state = {"tok_embeddings.weight": raw["tok_embeddings"], "norm.weight": raw["norm"],
             "output.weight": raw["output"] if not shared else raw["tok_embeddings"]}
    for i in range(L):
        for short, meta in names.items():
            state[f"layers.{i}.{meta}.weight"] = raw[short][i]
    return args, state, seq_len


def check_tokenizer(path, vocab_size: int) -> Path:
    """A sentencepiece model whose vocabulary matches the weights (llama2.c's tokN.bin is not one)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {path} not found")
    import sentencepiece

    try:
        n = sentencepiece.SentencePieceProcessor(model_file=str(path)).vocab_size()
    except Exception as e:
        raise ValueError(
            f"{path} is not a sentencepiece model ({type(e).__name__}); llama2.c's tokN.bin exports cannot be "
            "used, pass the .model file they were made from"
        ) from None
    if n != vocab_size:
        raise ValueError(f"tokenizer {path} has {n} pieces but the model's vocab_size is {vocab_size}")
    return path


def convert_llama2c(model_bin, out_dir, tokenizer=None, shards: int = 1) -> List[Path]:
    args, state, seq_len = read_llama2c(model_bin)
    extra = {"tokenizer.model": check_tokenizer(tokenizer, args.vocab_size)} if tokenizer else None
    return save_checkpoint(state, meta_params(args), out_dir, shards, extra_files=extra)


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face

def convert_hf(hf_dir, out_dir, shards: int = 1, dtype: Optional[torch.dtype] = None) -> List[Path]:
    """A Meta-layout copy of a Hugging Face directory of any family hf_checkpoint reads (params.json names what the
    family changes: head_dim, hidden_dim, qkv_bias, sliding_window, rope_scaling, Granite's multipliers, qk_norm,
    moe)."""
    hf_dir = Path(hf_dir)
    params, state = hf_checkpoint.load(hf_dir, dtype)
    args = ModelArgs(**params)
    # Llama 3 repositories keep Meta's tiktoken file under original/; a tokenizer.json (with its
    # tokenizer_config.json) loads as tokenizer_path=OUT_DIR/tokenizer.json
    found = [p for p in (hf_dir / "tokenizer.model", hf_dir / "original" / "tokenizer.model") if p.is_file()]
    extra = {"tokenizer.model": found[0]} if found else {}
    extra.update({name: hf_dir / name for name in ("tokenizer.json", "tokenizer_config.json")
                  if (hf_dir / name).is_file()})
    if not extra:
        print(f"note: {hf_dir} has no tokenizer.model or tokenizer.json: the converted checkpoint has no tokenizer",
              file=sys.stderr)
    return save_checkpoint(state, meta_params(args), out_dir, shards, extra_files=extra or None)


# ---------------------------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llama.convert", description="Convert checkpoints to Meta's layout.")
    sub = parser.add_subparsers(dest="fmt", required=True)
    p = sub.add_parser("llama2c", help="llama2.c .bin (v0 legacy or v1 header, fp32)")
    p.add_argument("model_bin")
    p.add_argument("out_dir")
    p.add_argument("--tokenizer", help="sentencepiece tokenizer.model to copy alongside")
    p.add_argument("--shards", type=int, default=1)
    h = sub.add_parser("hf", help="Hugging Face directory of Llama, Mistral, Qwen2, Phi-3 or Granite (config.json + safetensors or *.bin)")
    h.add_argument("hf_dir")
    h.add_argument("out_dir")
    h.add_argument("--shards", type=int, default=1)
    h.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="cast weights (default: keep)")
    g = sub.add_parser("gguf", help="a llama-architecture GGUF file (weights dequantized; its tokenizer as tokenizer.json)")
    g.add_argument("gguf_file")
    g.add_argument("out_dir")
    g.add_argument("--shards", type=int, default=1)
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    a = parser.parse_args(argv)
    try:
        if a.fmt == "llama2c":
            written = convert_llama2c(a.model_bin, a.out_dir, a.tokenizer, a.shards)
        elif a.fmt == "gguf":
            written = gguf_file.convert(a.gguf_file, a.out_dir, a.shards, getattr(torch, a.dtype))
        else:
            written = convert_hf(a.hf_dir, a.out_dir, a.shards, getattr(torch, a.dtype) if a.dtype else None)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(p.name for p in written)} and checklist.chk to {a.out_dir}")
    return 0

