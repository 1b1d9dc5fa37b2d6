"""Convert other checkpoint formats into the Meta layout this package loads.

    python -m llama.convert llama2c MODEL.bin OUT_DIR [--tokenizer tok.model] [--shards N]
    python -m llama.convert hf HF_DIR OUT_DIR [--shards N] [--dtype bfloat16]

llama2.c files (Karpathy's tinyllamas and its export.py: legacy v0 header or the v1 "ak42" header) hold fp32
weights with the same rotary convention as Meta's, so values are copied unchanged. Hugging Face checkpoints
permute the rows of q_proj/k_proj for their rotate-half rotary; that permutation is undone here. Safetensors files
are read by a small built-in reader, so the `safetensors` package is not needed.
"""

import argparse
import json
import math
import mmap
import struct
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from llama.formats import gguf_file as gguf_checkpoint
from llama.formats.meta_checkpoint import load_shard, save_checkpoint
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

def read_safetensors(path) -> Dict[str, torch.Tensor]:
    """Tensors of a .safetensors file, memory-mapped by the safetensors package (as Hugging Face reads them)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None


def read_hf_weights(hf_dir: Path) -> Dict[str, torch.Tensor]:
    """All tensors of a HF model directory: (sharded) safetensors, else (sharded) pytorch_model*.bin."""
    for index_name, reader in (("model.safetensors.index.json", read_safetensors),
                               ("pytorch_model.bin.index.json", load_shard)):
        index = hf_dir / index_name
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            break
    else:
        files = [p.name for p in sorted(hf_dir.glob("*.safetensors"))] or \
                [p.name for p in sorted(hf_dir.glob("pytorch_model*.bin"))]
        if not files:
            raise FileNotFoundError(f"no model.safetensors or pytorch_model*.bin in {hf_dir}")
    state = {}
    for name in files:
        path = hf_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in the index but missing")
        state.update(read_safetensors(path) if name.endswith(".safetensors") else load_shard(path))
    return state


def hf_args(config: dict, source) -> ModelArgs:
    """ModelArgs from a Llama config.json; refuses features this architecture does not implement."""
    if config.get("model_type", "llama") != "llama":
        raise ValueError(f"{source}: model_type {config.get('model_type')!r} is not 'llama'")
    for key, ok in (("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, ok) not in (ok, None):
            raise ValueError(f"{source}: {key}={config[key]!r} is not supported by this Llama implementation")
    rope = hf_rope(config, source)
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {config['hidden_act']!r} is not silu")
    try:
        dim, n_heads = config["hidden_size"], config["num_attention_heads"]
        hidden, layers, vocab = config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
    except KeyError as e:
        raise ValueError(f"{source} lacks {e.args[0]!r}") from None
    if config.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"{source}: head_dim {config['head_dim']} differs from hidden_size/num_attention_heads")
    multiple_of, mult = derive_ffn(dim, hidden)
    return ModelArgs(dim=dim, n_layers=layers, n_heads=n_heads,
                     n_kv_heads=config.get("num_key_value_heads") or n_heads, vocab_size=vocab,
                     multiple_of=multiple_of, ffn_dim_multiplier=mult, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                     **rope)


def hf_rope(config: dict, source) -> dict:
    """ModelArgs' rotary fields from config.json: rope_theta, and Llama 3.1's scaling from `rope_scaling` (older
    transformers) or `rope_parameters` (newer, which also holds rope_theta). Other scaling types are refused."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or params
    out = {"rope_theta": float(params.get("rope_theta", config.get("rope_theta", 10000.0)))}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return out
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    if kind != "llama3":
        raise ValueError(f"{source}: {key} of type {kind!r} is not supported by this Llama implementation "
                         "(only Llama 3.1's 'llama3' scaling is)")
    try:
        return {**out, "use_scaled_rope": True, "rope_scaling_factor": float(scaling["factor"]),
                "rope_low_freq_factor": float(scaling["low_freq_factor"]),
                "rope_high_freq_factor": float(scaling["high_freq_factor"]),
                "rope_original_context": int(scaling["original_max_position_embeddings"])}
    except KeyError as e:
        raise ValueError(f"{source}: {key} of type 'llama3' lacks {e.args[0]!r}") from None


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo HF's q/k row permutation (rotate-half order back to Meta's interleaved pairs)."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


_HF_LAYER = {
    "self_attn.q_proj.weight": "attention.wq.weight", "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight", "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_GLOBAL = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight"}


def hf_to_meta(hf: Dict[str, torch.Tensor], args: ModelArgs, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """Rename HF tensors to Meta's names and undo the q/k permutation; a missing lm_head means tied embeddings."""
    out = {}
    for name, t in hf.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older HF checkpoints save; recomputed from rope_theta
        parts = name.split(".")
        if name in _HF_GLOBAL:
            meta = _HF_GLOBAL[name]
        elif parts[:2] == ["model", "layers"] and len(parts) > 3 and ".".join(parts[3:]) in _HF_LAYER:
            meta = f"layers.{parts[2]}.{_HF_LAYER['.'.join(parts[3:])]}"
        else:
            raise ValueError(f"unexpected tensor {name!r} in the Hugging Face checkpoint: not a Llama parameter")
        if meta.endswith("wq.weight"):
            t = unpermute(t, args.n_heads)
        elif meta.endswith("wk.weight"):
            t = unpermute(t, args.n_kv_heads)
        out[meta] = t.to(dtype) if dtype is not None else t
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]  # tie_word_embeddings
    return out


def convert_hf(hf_dir, out_dir, shards: int = 1, dtype: Optional[torch.dtype] = None) -> List[Path]:
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    args = hf_args(config, config_path)
    state = hf_to_meta(read_hf_weights(hf_dir), args, dtype)
    # Llama 3 repositories keep Meta's tiktoken file under original/; tokenizer.json alone is not Meta's format.
    found = [p for p in (hf_dir / "tokenizer.model", hf_dir / "original" / "tokenizer.model") if p.is_file()]
    extra = {"tokenizer.model": found[0]} if found else None
    if not found and (hf_dir / "tokenizer.json").is_file():
        print(f"note: {hf_dir} has tokenizer.json but no tokenizer.model: the converted checkpoint has no tokenizer; "
              "pass Meta's tokenizer.model (for Llama 3, original/tokenizer.model of the same repository) as "
              "--tokenizer_path", file=sys.stderr)
    return save_checkpoint(state, meta_params(args), out_dir, shards, extra_files=extra)


# ---------------------------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llama.convert", description="Convert checkpoints to Meta's layout.")
    sub = parser.add_subparsers(dest="fmt", required=True)
    p = sub.add_parser("llama2c", help="llama2.c .bin (v0 legacy or v1 header, fp32)")
    p.add_argument("model_bin")
    p.add_argument("out_dir")
    p.add_argument("--tokenizer", help="sentencepiece tokenizer.model to copy alongside")
    p.add_argument("--shards", type=int, default=1)
    h = sub.add_parser("hf", help="Hugging Face Llama directory (config.json + safetensors or pytorch_model*.bin)")
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
            written = gguf_checkpoint.convert(a.gguf_file, a.out_dir, a.shards, getattr(torch, a.dtype))
        else:
            written = convert_hf(a.hf_dir, a.out_dir, a.shards, getattr(torch, a.dtype) if a.dtype else None)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {', '.join(p.name for p in written)} and checklist.chk to {a.out_dir}")
    return 0

