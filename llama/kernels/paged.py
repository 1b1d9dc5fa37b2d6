"""Reads and writes of the paged KV pool (llama/core/kv_cache.py) in pure torch, for every path other than our CPU
decode kernel (which reads the blocks in place): SDPA prefill, the compiled decode step, CUDA.

The pool's caches are (blocks, kv_heads, block_size, head_dim); `table` holds the blocks of each row of a pass
(B, blocks per row), so row b's position p is in block table[b, p // block_size] at offset p % block_size.

An int8 pool (kv_cache_dtype="int8") is llama.cpp's q8_0 per position (its scales bitwise): each group of GROUP
values within a head (a whole head where head_dim is not a multiple of GROUP) has int8 codes and an fp16 scale,
amax / 127, in the cache tensor's `scales` attribute (blocks, kv_heads, block_size, head_dim // group). A
position's bytes never depend on its neighbours, so a cached block holds what a fresh prefill would write. Groups
of 32 rather than one scale per head: a head's few largest values set its scale, too coarse for the rest (SmolLM2:
25 % less error in keys and values; the same bytes at head_dim 64, +3 % at 128; docs/performance.md, "int8 keys
and values"). A code times an fp16 scale is exact in fp32, so dequantizing rounds once, to the activations' dtype.
"""

import torch


GROUP = 32  # values per scale within a head: q8_0's block


def group_size(head_dim: int) -> int:
    return GROUP if head_dim % GROUP == 0 else head_dim


def quantize(x: torch.Tensor):
    """int8 codes (x's shape) and fp16 scales (x.shape[:-1] + (groups,)) of x, symmetric per group of a head. The
    scale is q8_0's, bitwise (amax / 127 in fp32, stored in fp16; only one past fp16's range is clamped, where q8_0
    would store inf); the codes are rounded against the scale as stored, not q8_0's fp32 one, so each value is
    within half a step of what is read back (q8_0's codes can be one off that, its error 0.2 % larger)."""
    g = group_size(x.shape[-1])
    groups = x.float().unflatten(-1, (-1, g))
    scale = (groups.abs().amax(dim=-1) / 127.0).clamp(max=65504.0).to(torch.float16)
    s = scale.float()[..., None]
    codes = torch.where(s > 0, groups / s, torch.zeros_like(groups)).round().clamp(-127, 127)
    return codes.to(torch.int8).flatten(-2), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """Values in dtype of int8 codes (..., head_dim) and their scales (..., groups)."""
    g = codes.shape[-1] // scales.shape[-1]
    return (codes.float().unflatten(-1, (-1, g)) * scales.float()[..., None]).flatten(-2).to(dtype)


def write(cache: torch.Tensor, blocks, offsets, x: torch.Tensor) -> None:
    if cache.dtype == torch.int8:
        codes, scale = quantize(x)
        cache[blocks, :, offsets] = codes
        cache.scales[blocks, :, offsets] = scale
    else:
        cache[blocks, :, offsets] = x.to(cache.dtype)


def store(cache_k: torch.Tensor, cache_v: torch.Tensor, table: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          positions: torch.Tensor) -> None:
    """Write keys/values (B, T, kv_heads, head_dim) at positions (B or 1, T) of the table's rows."""
    B, T = k.shape[:2]
    bs = cache_k.shape[2]
    pos = positions.expand(B, T)
    blocks = table.gather(1, pos // bs)  # (B, T)
    write(cache_k, blocks, pos % bs, k)
    write(cache_v, blocks, pos % bs, v)


def read(cache_k: torch.Tensor, cache_v: torch.Tensor, table: torch.Tensor, kv_len: int, dtype=None):
    """Keys and values (B, kv_heads, kv_len, head_dim) of positions 0..kv_len-1 of the table's rows (a gather);
    an int8 pool's dequantized to dtype."""
    bs = cache_k.shape[2]
    table = table[:, : -(-kv_len // bs)]
    out = []
    for cache in (cache_k, cache_v):
        g = cache[table]  # (B, blocks, kv_heads, block_size, head_dim)
        if cache.dtype == torch.int8:
            g = dequantize(g, cache.scales[table], dtype)
        g = g.transpose(1, 2)
        out.append(g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])[:, :, :kv_len])
    return out


def flat_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, rows, B: int, T: int):
    """A pass of B rows of T tokens as B * T one-token rows of the decode kernel (row-invariant attention,
    llama/kernels/invariant.py): (cos, sin, positions, cache rows), one per token. It writes every token's key and
    value before any attends, and each attends over its own row's positions 0..its own, as the causal mask does."""
    half = cos.shape[-1]
    cos, sin = (t.expand(B, T, half).reshape(B * T, half) for t in (cos, sin))
    if rows is None or isinstance(rows, slice):
        first = 0 if rows is None else rows.start or 0
        rows = torch.arange(first, first + B, device=positions.device)
    return cos, sin, positions.expand(B, T).reshape(B * T), rows.repeat_interleave(T)
