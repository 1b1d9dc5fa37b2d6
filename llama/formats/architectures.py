"""What each GGUF `general.architecture` of the LLaMA-style families changes, as llama.cpp's converter writes it:
hyperparameters into ModelArgs fields, and the tensor layout into Meta's.

- llama (Llama 2/3 (3.1's scaling as `rope_freqs.weight`), SmolLM2, Mistral's files, which carry no window), granite (its four scales): q/k rows are in
  Meta's interleaved rotary order already (the converter permutes them).
- qwen2 (q/k/v biases), phi3 (fused attn_qkv, ffn_up holding gate and up, long-rope factor tensors), qwen3 and
  qwen3moe (qk-norm): NeoX rotary with q/k rows (and the qk-norm weights) as Hugging Face stores them, so they are
  permuted here into Meta's order.
- llama4 (Llama 4's text model): q/k rows as Hugging Face stores them, which for Llama 4 is Meta's interleaved order
  (the converter permutes nothing); the shared expert's ffn_{gate,up,down}_shexp; what the metadata does not carry
  (chunk, NoPE interval, temperature, L2 qk-norm) is what llama.cpp fixes for the architecture (llama4_params).
- mixture of experts (qwen3moe, llama4, and Mixtral's `llama` files with `llama.expert_count`): the router ffn_gate_inp and
  the experts' ffn_{gate,up,down}_exps, each one (n_experts, rows, row bytes) tensor, cut here into one tensor per
  expert under the older files' names (blk.N.ffn_gate.E.weight ...), so both layouts read alike.

adapt() rewrites a reader's tensor list once, before anything reads it: fused tensors become row ranges of their
parts and q/k rows a permuted copy, all under the names the plain llama layout uses, so every reading path
(whole file, layer by layer, pipeline stage) sees one layout. Row ranges of a quantized tensor are whole blocks
(GGUF blocks run along a row), so nothing is dequantized early.
"""

from pathlib import Path

import numpy as np

from llama import rope
from llama.model import derive_ffn

SUPPORTED = ("llama", "qwen2", "phi3", "granite", "qwen3", "qwen3moe", "llama4")
NEOX = ("qwen2", "phi3", "qwen3", "qwen3moe")  # q/k rows in Hugging Face's rotate-half order
QK_NORM = ("qwen3", "qwen3moe")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # (n_experts, rows, row bytes): one tensor per projection


def field(reader, key: str, default=None, path=None):
    f = reader.fields.get(key)
    if f is None:
        if default is not None:
            return default
        raise ValueError(f"{path}: GGUF metadata lacks {key!r}")
    return f.contents()


def architecture(reader, path) -> str:
    arch = field(reader, "general.architecture", path=path)
    if arch not in SUPPORTED:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})")
    return arch


def read_params(reader, path: Path) -> dict:
    """params.json-style hyperparameters from the metadata (ModelArgs fields); refuses what the model cannot run."""
    arch = architecture(reader, path)
    g = lambda key, default=None: field(reader, f"{arch}.{key}", default, path)  # noqa: E731
    dim, n_heads = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", dim // n_heads))
    rot = int(g("rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count {rot} differs from the head dimension {head_dim}")
    hidden = int(g("feed_forward_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    params = {"dim": dim, "n_layers": int(g("block_count")), "n_heads": n_heads,
              "n_kv_heads": int(g("attention.head_count_kv", n_heads)),
              "vocab_size": int(g("vocab_size", len(tokens.data) if tokens is not None else 0)),
              "norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
              "rope_theta": float(g("rope.freq_base", 10000.0))}
    if head_dim != dim // n_heads:
        params["head_dim"] = head_dim
    try:
        params["multiple_of"], mult = derive_ffn(dim, hidden)
        if mult is not None:
            params["ffn_dim_multiplier"] = mult
    except ValueError:
        params["hidden_dim"] = hidden
    if "blk.0.attn_q.bias" in names:
        params["qkv_bias"] = True
    window = int(g("attention.sliding_window", 0))
    if window > 0:
        params["sliding_window"] = window
    if arch in QK_NORM:
        params["qk_norm"] = True
    moe = moe_params(reader, arch, path, hidden)
    if moe is not None:
        params["moe"] = moe
    if arch == "llama4":
        params.update(llama4_params(reader, path, params))
    if arch == "granite":
        params.update(attention_multiplier=float(g("attention.scale", head_dim ** -0.5)),
                      embedding_multiplier=float(g("embedding_scale", 1.0)),
                      residual_multiplier=float(g("residual_scale", 1.0)), logits_scaling=float(g("logit_scale", 1.0)))
    scaling = rope_scaling(reader, arch, path, head_dim)
    if scaling is not None:
        params["rope_scaling"] = scaling
    return params


def moe_params(reader, arch: str, path, hidden: int):
    """ModelArgs.moe from `{arch}.expert_count` and friends (None for a dense model); llama.cpp's graph for these
    architectures renormalises the top-k weights and scales them by nothing else."""
    g = lambda key, default=None: field(reader, f"{arch}.{key}", default, path)  # noqa: E731
    n = int(g("expert_count", 0))
    if n == 0:
        return None
    scale = float(g("expert_weights_scale", 1.0))
    if scale not in (0.0, 1.0):
        raise ValueError(f"{path}: {arch}.expert_weights_scale {scale:g} is not supported (only 1)")
    every = int(g("interleave_moe_layer_step", 1)) or 1
    return {"n_experts": n, "top_k": int(g("expert_used_count")), "every": every,
            "hidden_dim": int(g("expert_feed_forward_length", hidden)), "renormalize": True}


# What llama.cpp's llama4 graph fixes rather than reads (src/models/llama4.cpp): chunks of 8192 positions on the
# layers that rotate, every 4th layer without rotation (n_no_rope_layer_step), the NoPE layers' temperature
# log(floor((p + 1) / 8192) + 1) * 0.1 + 1, and the L2 qk-norm unless the model has 128 experts (Maverick).
LLAMA4_CHUNK, LLAMA4_NOPE, LLAMA4_FLOOR, LLAMA4_TEMP = 8192, 4, 8192.0, 0.1


def llama4_params(reader, path, params: dict) -> dict:
    """ModelArgs fields of a `llama4` file as llama.cpp computes it; refuses the variants llama.cpp computes
    differently from Llama 4 (no experts, all layers global, another chunk pattern or a separate chunk theta)."""
    g = lambda key, default=None: field(reader, f"llama4.{key}", default, path)  # noqa: E731
    moe = params.get("moe")
    if moe is None:
        raise ValueError(f"{path}: a llama4 file without llama4.expert_count (llama.cpp's MobileLLM layout) is not "
                         "supported: Llama 4's text model has experts")
    if int(g("attention.sliding_window", LLAMA4_CHUNK)) == 0:
        raise ValueError(f"{path}: llama4.attention.sliding_window 0 (every layer global, llama.cpp's MobileLLM "
                         "layout) is not supported: Llama 4 attends within chunks")
    pattern = reader.fields.get("llama4.attention.sliding_window_pattern")
    if pattern is not None:
        value = pattern.contents()
        n = params["n_layers"]
        chunked = [bool(v) for v in value] if isinstance(value, list) else \
            [i % int(value) < int(value) - 1 for i in range(n)]
        if chunked != [(i + 1) % LLAMA4_NOPE != 0 for i in range(n)]:
            raise ValueError(f"{path}: llama4.attention.sliding_window_pattern {value} is not every 4th layer "
                             "global, which llama.cpp ties to its NoPE layers (every 4th) and this Llama "
                             "implementation cannot compute apart")
    base = g("rope.freq_base_swa", params["rope_theta"])
    if float(base) != params["rope_theta"]:
        raise ValueError(f"{path}: llama4.rope.freq_base_swa {float(base):g} differs from llama4.rope.freq_base "
                         f"{params['rope_theta']:g}, which Llama 4 does not have")
    scale = float(g("attention.scale", 0.0))
    head_dim = params.get("head_dim", params["dim"] // params["n_heads"])
    if scale not in (0.0, head_dim ** -0.5):
        raise ValueError(f"{path}: llama4.attention.scale {scale:g} is not supported (only head_dim ** -0.5)")
    moe = {**moe, "router": "sigmoid", "renormalize": False, "scale_inputs": True, "shared_expert": True}
    return {"moe": moe, "attention_chunk_size": LLAMA4_CHUNK, "nope_layer_interval": LLAMA4_NOPE,
            "qk_l2_norm": moe["n_experts"] != 128, "attn_temperature_tuning": True, "floor_scale": LLAMA4_FLOOR,
            "attn_scale": LLAMA4_TEMP}


def rope_scaling(reader, arch: str, path, head_dim: int):
    """ModelArgs.rope_scaling from the metadata: linear, YaRN, or Phi-3's long-rope factor tensors."""
    g = lambda key, default=None: field(reader, f"{arch}.{key}", default, path)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:  # Llama 3.1's scaling, as one divisor per frequency
        return {"rope_type": "factors",
                "factors": np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).tolist()}
    if "rope_factors_long.weight" in tensors:
        original = int(g("rope.scaling.original_context_length"))
        factor = int(g("context_length")) / original
        attention = float(g("rope.scaling.attn_factor", rope.longrope_attention_factor(factor, original)))
        factors = {k: np.asarray(tensors[f"rope_factors_{k}.weight"].data, dtype=np.float32).tolist()
                   for k in ("long", "short")}
        return {"rope_type": "longrope", "short_factor": factors["short"], "long_factor": factors["long"],
                "original_context": original, "attention_factor": attention}
    kind = str(g("rope.scaling.type", "none"))
    if kind in ("none", ""):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    if kind == "yarn":
        factor = float(g("rope.scaling.factor"))
        return {"rope_type": "yarn", "factor": factor, "original_context": int(g("rope.scaling.original_context_length")),
                "beta_fast": float(g("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(g("rope.scaling.yarn_beta_slow", 1.0)), "truncate": True,
                "attention_factor": rope.yarn_attention_factor(factor)}
    raise ValueError(f"{path}: {arch}.rope.scaling.type {kind!r} is not supported (supported: none, linear, yarn)")


def neox_to_meta(rows: int, n_heads: int) -> np.ndarray:
    """Row order that takes q or k rows from rotate-half order within each head to Meta's interleaved pairs."""
    return np.arange(rows).reshape(n_heads, 2, rows // n_heads // 2).transpose(0, 2, 1).reshape(-1)


def _part(t, name: str, rows):
    """Reader tensor t restricted to `rows` (a slice or an index array) of its rows, renamed."""
    data = t.data[rows]
    n_rows = data.shape[0]
    shape = t.shape.copy()
    shape[-1] = n_rows  # GGUF lists the fastest dimension first: rows are the last
    row_bytes = int(t.n_bytes) // t.data.shape[0]
    first = rows.start or 0 if isinstance(rows, slice) else 0  # where a row range starts (for releasing its pages)
    return t._replace(name=name, data=data, shape=shape, n_elements=int(np.prod(shape)),
                      n_bytes=row_bytes * n_rows, data_offset=int(t.data_offset) + first * row_bytes)


def _expert(t, name: str, e: int):
    """Expert e's matrix of a (n_experts, rows, row bytes) reader tensor, renamed (a view of the file)."""
    data = t.data[e]
    shape = t.shape[:2].copy()
    size = int(t.n_bytes) // t.data.shape[0]
    return t._replace(name=name, data=data, shape=shape, n_elements=int(np.prod(shape)), n_bytes=size,
                      data_offset=int(t.data_offset) + e * size)  # its own bytes: gguf_file.release drops them


def split_experts(t, prefix: str, local: str) -> list:
    """A layer's ffn_*_exps tensor as one tensor per expert, named as the older per-expert files name them."""
    proj = local.split("_exps")[0]  # ffn_gate, ffn_up, ffn_down
    return [_expert(t, f"{prefix}{proj}.{e}.weight", e) for e in range(t.data.shape[0])]


def adapt(reader, path, params: dict) -> None:
    """Rewrite reader.tensors into the plain llama layout (see the module docstring); once per reader."""
    if getattr(reader, "llama_layout", False):
        return
    arch = architecture(reader, path)
    n_heads, n_kv = params["n_heads"], params.get("n_kv_heads", params["n_heads"])
    head_dim = params.get("head_dim", params["dim"] // n_heads)
    q, kv = n_heads * head_dim, n_kv * head_dim
    out = []
    for t in reader.tensors:
        parts = t.name.split(".", 2)
        prefix, local = (f"{parts[0]}.{parts[1]}.", parts[2]) if parts[0] == "blk" and len(parts) == 3 else ("", t.name)
        if t.name.startswith("rope_factors_") or t.name == "rope_freqs.weight":
            continue  # read into params["rope_scaling"]
        if arch == "phi3" and local == "attn_qkv.weight":
            out += [_part(t, prefix + "attn_q.weight", slice(0, q)), _part(t, prefix + "attn_k.weight", slice(q, q + kv)),
                    _part(t, prefix + "attn_v.weight", slice(q + kv, q + 2 * kv))]
            continue
        if arch == "phi3" and local == "ffn_up.weight" and t.data.shape[0] % 2 == 0:
            half = t.data.shape[0] // 2
            out += [_part(t, prefix + "ffn_gate.weight", slice(0, half)), _part(t, prefix + "ffn_up.weight",
                                                                                 slice(half, 2 * half))]
            continue
        if local.rsplit(".", 1)[0] in EXPERTS:
            out += split_experts(t, prefix, local)
            continue
        out.append(t)
    if arch in NEOX:
        for i, t in enumerate(out):
            local = t.name.rpartition("attn_")[2]
            if t.name.startswith("blk.") and local in ("q.weight", "q.bias", "k.weight", "k.bias"):
                out[i] = _part(t, t.name, neox_to_meta(t.data.shape[0], n_heads if local[0] == "q" else n_kv))
            elif t.name.startswith("blk.") and local in ("q_norm.weight", "k_norm.weight"):  # within one head
                out[i] = _part(t, t.name, neox_to_meta(t.data.shape[0], 1))
    reader.tensors = out
    reader.llama_layout = True
