"""Row-invariant attention over an int8 paged pool (kv_cache_dtype="int8" under prefix_cache="exact",
llama/kernels/invariant.py).

The torch path (llama/kernels/paged.py read, then SDPA) reduces over the pass's KV length and batch, so a position's
output would depend on how its prompt was chunked and on what else ran. Our decode kernel attends each query row over
its own positions 0..p in one fixed order, but reads fp32 or bf16 caches only. So: the pass's keys and values are
written to the int8 pool first (quantized, as always), the blocks the pass reads are dequantized into a temporary
pool in the activations' dtype (the same arithmetic as paged.read), and the kernel attends over that, every token a
row of its own. Its rotation is made the identity (cos 1, sin 0: x0 * 1 - x1 * 0 is x0 exactly), since the queries
come rotated; the keys and values it writes for the pass's own tokens are their dequantized values, which the
temporary pool already holds, so every query sees what a later pass reads back from the cache.
"""

import torch

from llama.kernels import cpu
from llama.kernels import paged


def takes(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether attend() runs: an int8 pool, activations of fp32 or bf16, head_dim a multiple of 8, kernels built."""
    return cache.dtype == torch.int8 and q.dtype in (torch.float32, torch.bfloat16) and cache.shape[-1] % 8 == 0 \
        and q.device.type == "cpu" and not torch.compiler.is_compiling() and cpu.available()


def dequantized(cache: torch.Tensor, scales: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of an int8 pool (codes and their scales) as (len(blocks), kv_heads, block_size, head_dim) in dtype, in
    the pool's basis (paged.read's arithmetic, stored=True)."""
    return paged.dequantize(cache[blocks], scales[blocks], dtype).contiguous()


def attend(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, table: torch.Tensor,
           positions: torch.Tensor, kv_len: int, scale=None, window=None, scales: paged.Scales = None) -> torch.Tensor:
    """Attention of rotated queries q (B, T, heads, head_dim) at positions (B or 1, T) over the table's rows (B,
    blocks per row) of an int8 pool (scales: its keys' and values' scales) that already holds the pass's keys and
    values; returns (B * T, heads * head_dim) in q's dtype. Token (b, t) attends its row's positions
    0..positions[b, t] (at most kv_len - 1), the newest `window` of them if given, scores scaled by `scale` (None:
    head_dim ** -0.5), as cpu.decode_attention."""
    B, T, H, D = q.shape
    q, bs = paged.into_stored(q, cache_k), cache_k.shape[2]  # the pool's basis (paged.attending), out of it below
    used = table[:, : -(-kv_len // bs)]
    blocks, local = torch.unique(used, return_inverse=True)
    scales_k, scales_v = paged.scales_of(cache_k, scales)
    keys, values = dequantized(cache_k, scales_k, blocks, q.dtype), dequantized(cache_v, scales_v, blocks, q.dtype)
    pos = positions.expand(B, T).reshape(-1).to(torch.int64)
    rows = torch.arange(B, device=q.device).repeat_interleave(T)
    at = local.to(torch.int64).contiguous()
    slot_block, slot = at[rows, pos // bs], pos % bs
    k = keys[slot_block, :, slot].reshape(B * T, -1)
    v = values[slot_block, :, slot].reshape(B * T, -1)
    cos = torch.ones(B * T, D // 2, dtype=torch.float32)
    sin = torch.zeros(B * T, D // 2, dtype=torch.float32)
    out = torch.ops.llama_cpu.decode_attention(q.reshape(B * T, H * D).contiguous(), k, v, cos, sin, keys, values,
                                               at, rows, 0, pos.contiguous(), kv_len,
                                               0.0 if scale is None else float(scale), window or 0)
    return paged.from_stored(out.view(B * T, H, D), cache_k).view(B * T, H * D)
