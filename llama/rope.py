"""Rotary frequency scalings that Hugging Face configs name besides Llama 3.1's (llama/model.py has that one):
linear position interpolation, YaRN, and Phi-3's su/long-rope.

ModelArgs.rope_scaling holds one of them as a resolved dict (every value the tables need, none derived later from
a config): {"rope_type": "linear", "factor"}, {"rope_type": "yarn", "factor", "original_context", "beta_fast",
"beta_slow", "truncate", "attention_factor"} or {"rope_type": "longrope", "short_factor", "long_factor",
"original_context", "attention_factor"}, or {"rope_type": "factors", "factors"}: one divisor per frequency, as
llama.cpp's `rope_freqs.weight` holds Llama 3.1's scaling. The formulas are transformers' (modeling_rope_utils), so the tables match
theirs; YaRN's and long-rope's attention factor multiplies cos and sin, as there.

Llama 4's iRoPE (Meta's llama_models/llama4/model.py; the layers are llama/model.py IRoPEAttention): its RoPE layers
attend within chunks of attention_chunk_size positions (chunk_mask), their q and k L2-normalised after the rotation
(l2_norm); every nope_layer_interval-th layer has no rotation, attends globally, and may scale its queries by a
temperature that grows with the position (temperature). Scout's scaled frequencies: scaled_rope_args.
"""

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

TYPES = ("linear", "yarn", "longrope", "factors")
_KEYS = {"linear": ("factor",),
         "yarn": ("factor", "original_context", "beta_fast", "beta_slow", "truncate", "attention_factor"),
         "longrope": ("short_factor", "long_factor", "original_context", "attention_factor"),
         "factors": ("factors",)}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check(scaling: Optional[dict], head_dim: int) -> None:
    """ValueError naming the key for a rope_scaling dict the tables cannot use."""
    if scaling is None:
        return
    if not isinstance(scaling, dict) or scaling.get("rope_type") not in TYPES:
        raise ValueError(f"rope_scaling must be None or a dict whose rope_type is one of {TYPES}, got {scaling!r}")
    kind = scaling["rope_type"]
    missing = [k for k in _KEYS[kind] if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} lacks {', '.join(missing)}")
    if kind in ("linear", "yarn") and (not _number(scaling["factor"]) or scaling["factor"] <= 0):
        raise ValueError(f"rope_scaling factor must be a positive number, got {scaling['factor']!r}")
    if kind in ("yarn", "longrope"):
        ctx = scaling["original_context"]
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
            raise ValueError(f"rope_scaling original_context must be a positive integer, got {ctx!r}")
        if not _number(scaling["attention_factor"]) or scaling["attention_factor"] <= 0:
            raise ValueError(f"rope_scaling attention_factor must be a positive number, got "
                             f"{scaling['attention_factor']!r}")
    if kind in ("longrope", "factors"):
        for key in ("short_factor", "long_factor") if kind == "longrope" else ("factors",):
            values = scaling[key]
            if not isinstance(values, (list, tuple)) or len(values) != head_dim // 2 or \
                    not all(_number(v) and v > 0 for v in values):
                raise ValueError(f"rope_scaling {key} must be {head_dim // 2} positive numbers (head_dim / 2), "
                                 f"got {values!r}")


def _yarn(base_freqs: torch.Tensor, head_dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: frequencies blended between interpolated (divided by factor) and kept, by a linear ramp over the
    dimensions whose rotations in the original context fall between beta_slow and beta_fast."""
    def correction_dim(rotations):
        return head_dim * math.log(s["original_context"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return base_freqs / s["factor"] * (1 - keep) + base_freqs * keep


def frequencies(head_dim: int, theta: float, scaling: Optional[dict], max_seq_len: int) -> Tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim / 2,) fp32, factor on cos/sin). Long-rope's long factors are used when
    max_seq_len passes the original context, its short ones otherwise: chosen once, when the tables are built."""
    exponents = torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        long = max_seq_len > scaling["original_context"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** exponents), float(scaling["attention_factor"])
    freqs = 1.0 / (theta ** exponents)
    if scaling is None:
        return freqs, 1.0
    if scaling["rope_type"] == "linear":
        return freqs / scaling["factor"], 1.0
    if scaling["rope_type"] == "factors":
        return freqs / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    return _yarn(freqs, head_dim, theta, scaling), float(scaling["attention_factor"])


def yarn_attention_factor(factor: float, mscale: Optional[float] = None, mscale_all_dim: Optional[float] = None) -> float:
    """YaRN's default attention factor (transformers' get_mscale), when a config does not give one."""
    def get(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        return float(get(factor, mscale) / get(factor, mscale_all_dim))
    return get(factor)


def longrope_attention_factor(factor: float, original_context: int) -> float:
    """Long-rope's default attention factor: sqrt(1 + log(factor) / log(original context))."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_context))


def scale_rope_frequencies(freqs: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                           original_context: int) -> torch.Tensor:
    """Llama 3.1's long-context rotary scaling: frequencies whose wavelength is short against the original context
    stay, long ones are divided by `factor`, and those in between are blended linearly in context / wavelength."""
    wavelen = 2 * math.pi / freqs
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > original_context / low_freq_factor, freqs / factor, blended)
    return torch.where(wavelen < original_context / high_freq_factor, freqs, out)


def rope_tables(head_dim: int, end: int, theta: float = 10000.0, scaling: Optional[dict] = None,
                other: Optional[dict] = None, max_seq_len: Optional[int] = None):
    """cos/sin of the reference's rotary frequencies, shape (end, head_dim // 2), fp32; scaling: the keyword
    arguments of scale_rope_frequencies (Llama 3.1+), or None; other: ModelArgs.rope_scaling (llama/rope.py, which
    long-rope chooses its factors in by max_seq_len), or None."""
    if other is None:
        freqs, factor = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim)), 1.0
    else:
        freqs, factor = frequencies(head_dim, theta, other, end // 2 if max_seq_len is None else max_seq_len)
    if scaling is not None:
        freqs = scale_rope_frequencies(freqs, **scaling)
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    if factor != 1.0:
        return torch.cos(angles) * factor, torch.sin(angles) * factor
    return torch.cos(angles), torch.sin(angles)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Meta's rmsnorm without a weight over the last dimension: in fp32, rounded back to x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


def temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """The queries' scale at positions (B|1, T): log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1, fp32, as
    (B|1, T, 1, 1)."""
    p = positions.to(torch.float32)
    return (torch.log(torch.floor((p + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0)[:, :, None, None]


def chunk_mask(positions: torch.Tensor, kv_len: int, chunk: int) -> torch.Tensor:
    """(B|1, 1, T, kv_len) bool: a query at p sees keys (p // chunk) * chunk .. p."""
    key_pos = torch.arange(kv_len, device=positions.device)[None, None, :]
    p = positions[:, :, None]
    return ((key_pos <= p) & (key_pos >= torch.div(p, chunk, rounding_mode="floor") * chunk))[:, None]


def causal_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    key_pos = torch.arange(kv_len, device=positions.device)[None, None, :]
    return (key_pos <= positions[:, :, None])[:, None]


def scaled_rope_args(theta: float, head_dim: int, factor: float, low: float, high: float, context: int) -> dict:
    """ModelArgs' rotary fields for Llama 3.1-style scaling with these factors. Llama 4 Scout's low and high
    frequency factors are equal (1 and 1: Meta's defaults): a step, no blend between them, which
    ModelArgs' use_scaled_rope (low < high) does not take; it becomes one divisor per frequency (rope "factors":
    `factor` past the original context's wavelength, 1 below), the same frequencies Meta's apply_scaling gives."""
    if low < high:
        return {"use_scaled_rope": True, "rope_scaling_factor": float(factor), "rope_low_freq_factor": float(low),
                "rope_high_freq_factor": float(high), "rope_original_context": int(context)}
    if low != high:
        raise ValueError(f"rope low_freq_factor ({low}) must be at most high_freq_factor ({high})")
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    wavelen = 2 * math.pi / freqs
    factors = [float(factor) if w > context / low else 1.0 for w in wavelen.tolist()]
    return {"rope_scaling": {"rope_type": "factors", "factors": factors}}


# Meta's rotary functions (llama, llama3, llama-models), for code written against them; the model uses the above.
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0, use_scaled: bool = False) -> torch.Tensor:
    """Meta's complex64 table (end, dim // 2); use_scaled: llama-models' Llama 3.1 scaling (factor 8, 8192)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    if use_scaled:
        freqs = scale_rope_frequencies(freqs, 8.0, 1.0, 4.0, 8192)
    angles = torch.outer(torch.arange(end, device=freqs.device, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.ndim < 2 or tuple(freqs_cis.shape) != (x.shape[1], x.shape[-1]):
        raise ValueError(f"freqs_cis of shape {tuple(freqs_cis.shape)} must be (x.shape[1], x.shape[-1]) for x of "
                         f"shape {tuple(x.shape)}")
    return freqs_cis.view(*[d if i in (1, x.ndim - 1) else 1 for i, d in enumerate(x.shape)])


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Meta's rotation of (B, T, heads, head_dim) queries and keys by a complex multiply."""
    def rotate(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * reshape_for_broadcast(freqs_cis, xc)).flatten(3).type_as(x)
    return rotate(xq), rotate(xk)
