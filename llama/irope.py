"""Llama 4's attention (Meta's iRoPE): most layers rotate q and k and attend only within chunks of
attention_chunk_size positions, every nope_layer_interval-th layer has no rotation and attends globally.

What a layer does besides the base Attention (llama/model.py), in Meta's order (llama_models/llama4/model.py):
- RoPE layers: the rotation, then an L2 norm of each head of q and of k (qk_l2_norm: an RMS norm without a weight,
  eps = norm_eps), then attention under the chunk mask: a query at p sees keys (p // C) * C .. p;
- NoPE layers: no rotation and no norm; with attn_temperature_tuning the queries are scaled by
  log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1 (1 below floor_scale positions), then causal attention.

Every pass builds its own masks from the positions, so chunks hold in a prefill, a decode step, a speculative
verification (per-row positions), a prefix-cached suffix and the paged pool alike. Our CPU decode kernel and the
one-call decode step take a fixed window only (and rotate before any norm), so these layers never use them: they
run the masked SDPA path (ModelArgs.kernel_attends is false for these models). Under prefix_cache="exact" each
query attends alone, over just the keys it sees, so its result does not depend on the rest of the pass.
"""

import math

import torch
import torch.nn.functional as F

from llama.kernels import invariant
from llama.model import Attention, apply_rotary
from llama.model_args import ModelArgs


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


class IRoPEAttention(Attention):
    """Attention of Llama 4's layer layer_id: a RoPE (chunked) or NoPE (global) layer."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__(args)
        self.rope = not args.is_nope(layer_id)
        self.chunk = args.attention_chunk_size if self.rope else None
        self.l2 = args.qk_l2_norm and self.rope
        self.tuned = args.attn_temperature_tuning and not self.rope

    def projections(self, x):
        """q (B, T, heads, head_dim), k and v (B, T, kv_heads, head_dim): separate or fused products."""
        B, T, _ = x.shape
        nq, nkv, hd = self.n_local_heads, self.n_local_kv_heads, self.head_dim
        if self.wqkv is None:
            return self.wq(x).view(B, T, nq, hd), self.wk(x).view(B, T, nkv, hd), self.wv(x).view(B, T, nkv, hd)
        q, k, v = self.wqkv(x).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        return q.view(B, T, nq, hd), k.view(B, T, nkv, hd), v.view(B, T, nkv, hd)

    def forward(self, x, cos, sin, start, positions, rows, kv_len, mask):
        if not torch.compiler.is_compiling() and self.blocks is not None:
            self.blocks.direct()  # outside the runner: the slot layout (llama/kernels/paged.py BlockTable)
        q, k, v = self.projections(x)
        if self.rope:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.l2:
            q, k = l2_norm(q, self.args.norm_eps), l2_norm(k, self.args.norm_eps)
        if self.tuned:
            q = (q * temperature(positions, self.args.floor_scale, self.args.attn_scale)).to(q.dtype)
        if self.chunk is not None:
            mask = chunk_mask(positions, kv_len, self.chunk)
        elif mask is None:
            mask = causal_mask(positions, kv_len)
        return self.attend(q, k, v, start, positions, rows, kv_len, mask, False)

    def sdpa(self, q, keys, values, mask):
        """SDPA under the mask; while row-invariant arithmetic is on, one query at a time over just the keys it
        sees (a contiguous span), so its bits do not depend on the pass."""
        if not invariant.active():
            return super().sdpa(q, keys, values, mask)
        B, H, T, D = q.shape
        out = q.new_empty(B, H, T, D)
        for b in range(B):
            for t in range(T):
                seen = mask[b if mask.shape[0] > 1 else 0, 0, t].nonzero()
                lo, hi = int(seen[0]), int(seen[-1]) + 1
                out[b, :, t : t + 1] = super().sdpa(q[b : b + 1, :, t : t + 1], keys[b : b + 1, :, lo:hi].contiguous(),
                                                    values[b : b + 1, :, lo:hi].contiguous(), None)[0]
        return out


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
