"""Reads and writes of the paged KV pool (llama/core/kv_cache.py) in pure torch, for every path other than our CPU
decode kernel (which reads the blocks in place): SDPA prefill, the compiled decode step, CUDA.

The pool's caches are (blocks, kv_heads, block_size, head_dim); `table` holds the blocks of each row of a pass
(B, blocks per row), so row b's position p is in block table[b, p // block_size] at offset p % block_size.
"""

import torch


def store(cache_k: torch.Tensor, cache_v: torch.Tensor, table: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          positions: torch.Tensor) -> None:
    """Write keys/values (B, T, kv_heads, head_dim) at positions (B or 1, T) of the table's rows."""
    B, T = k.shape[:2]
    bs = cache_k.shape[2]
    pos = positions.expand(B, T)
    blocks = table.gather(1, pos // bs)  # (B, T)
    cache_k[blocks, :, pos % bs] = k.to(cache_k.dtype)
    cache_v[blocks, :, pos % bs] = v.to(cache_v.dtype)


def read(cache_k: torch.Tensor, cache_v: torch.Tensor, table: torch.Tensor, kv_len: int):
    """Keys and values (B, kv_heads, kv_len, head_dim) of positions 0..kv_len-1 of the table's rows (a gather)."""
    bs = cache_k.shape[2]
    table = table[:, : -(-kv_len // bs)]
    out = []
    for cache in (cache_k, cache_v):
        g = cache[table].transpose(1, 2)  # (B, kv_heads, blocks, block_size, head_dim)
        out.append(g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])[:, :, :kv_len])
    return out
