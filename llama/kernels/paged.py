"""Reads and writes of the paged KV pool (llama/core/worker/kv_cache.py) in pure torch, for every path other than our CPU
decode kernel (which reads the blocks in place): SDPA prefill, the compiled decode step, CUDA.

The pool's caches are (blocks, kv_heads, block_size, head_dim); `table` holds the blocks of each row of a pass
(B, blocks per row), so row b's position p is in block table[b, p // block_size] at offset p % block_size.

An int8 pool (kv_cache_dtype="int8") holds each position's head rotated, then as llama.cpp's q8_0 (its scales
bitwise): each group of GROUP values (a whole head where head_dim is not a multiple of GROUP) has int8 codes and an
fp16 scale, amax / 127, in a scales tensor beside the codes (blocks, kv_heads, block_size, head_dim // group): the
layer's cache_k_scales/cache_v_scales (llama/model.py Attention), passed here as `scales` (keys', values').
The rotation (rotate(): fixed signs, then a normalized Walsh-Hadamard transform of head_dim, as QuaRot does and
llama.cpp for its quantized KV types, ggml-org/llama.cpp#21038) spreads a head's few outlier channels over all of
them, so they no longer set a group's step: less error in the same bytes (measured in docs/performance.md, "int8
keys and values"). Attention needs no unrotation of the pool: q.k = (Rq).(Rk) and softmax(qK)V = R^T
(softmax(qK)(RV)), so the model rotates its queries into the stored basis and its output back
(attending()/unrotate()); read() gives the model's basis to anyone else. head_dims that are not a power of two keep
plain q8_0. The butterflies are elementwise fp32 adds in one fixed order, so a position's bytes never depend on its
neighbours or its batch: a cached block holds what a fresh prefill would write. A code times an fp16 scale is exact
in fp32, so dequantizing rounds once, to the activations' dtype.
"""

import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import torch


GROUP = 32  # values per scale within a head: q8_0's block
ROTATE = True  # rotate heads of a power-of-two head_dim before quantizing (False: plain q8_0, for comparisons)
_SIGNS: dict = {}
Scales = Optional[Tuple[torch.Tensor, torch.Tensor]]  # an int8 pool's (keys', values' scales); None: a float pool


@dataclass(eq=False)
class BlockTable:
    """The paged pool's block table and the layout it rests in between the runner's passes. llama/core/worker/kv_cache.py
    builds it; every Attention holds it (Attention.blocks) beside its block_table buffer, which is `tensor`.

    During the runner's passes (managed()) the scheduler's tables are live. A pass outside them (a direct model call:
    Meta's code, tests) calls direct() first: the rows go back to the slot layout of old, `home` (row r in blocks
    1 + r * per_row ..., as far as the pool has blocks), and since that layout's blocks may hold cached prefixes,
    which the pass overwrites, it calls `forget` (the cache forgets every prefix key and marks its prefixes stale)."""

    tensor: torch.Tensor  # (rows, blocks per row) int64, shared by every layer
    home: torch.Tensor  # the slot layout
    forget: Callable[[], None]
    saved: torch.Tensor = field(init=False)  # the runner's tables while the slot layout rests
    resting: bool = True
    managing: int = 0

    def __post_init__(self):
        self.tensor.copy_(self.home)
        self.saved = torch.zeros_like(self.tensor)

    def direct(self) -> None:
        """Before a pass outside the runner (eager: the model, the fused decode, the compiled step's caller)."""
        if self.managing:
            return
        if not self.resting:
            self.saved.copy_(self.tensor)
            self.tensor.copy_(self.home)
            self.resting = True
        self.forget()

    @contextmanager
    def managed(self):
        """The runner's passes: its tables are live."""
        if self.resting:
            self.tensor.copy_(self.saved)
            self.resting = False
        self.managing += 1
        try:
            yield
        finally:
            self.managing -= 1


def slot_table(rows: int, per_row: int, num_blocks: int, device, forget: Callable[[], None]) -> BlockTable:
    """A BlockTable of `rows` rows of per_row blocks, resting in the slot layout."""
    home = torch.arange(rows * per_row, device=device).view(rows, per_row) + 1
    home = torch.where(home <= num_blocks, home, torch.zeros_like(home))
    return BlockTable(torch.zeros((rows, per_row), dtype=torch.int64, device=device), home, forget)


def group_size(head_dim: int) -> int:
    return GROUP if head_dim % GROUP == 0 else head_dim


def rotates(head_dim: int) -> bool:
    """Whether an int8 pool of this head_dim stores its heads rotated: a power of two (SmolLM2's 64, Llama's 128)."""
    return ROTATE and head_dim > 1 and head_dim & (head_dim - 1) == 0


def scheme(head_dim: int) -> str:
    """The int8 pool's stored form, part of every prefix block's key (core/worker/kv_cache.py pool_salt): blocks of one
    form are never read as another."""
    return f"q8_0/{group_size(head_dim)}" + ("+signs-hadamard-v1" if rotates(head_dim) else "")


def _signs(n: int, device) -> torch.Tensor:
    """n fixed signs (Python's Mersenne Twister from seed n: the same in every process): they keep a vector that
    happens to lie along one Walsh function (a constant one, say) from collapsing onto a single channel."""
    key = (n, str(device))
    if key not in _SIGNS:
        bits = random.Random(n).getrandbits(n)
        _SIGNS[key] = torch.tensor([1.0 - 2.0 * (bits >> i & 1) for i in range(n)], device=device)
    return _SIGNS[key]


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The normalized Walsh-Hadamard transform of x's last dim (a power of two) in fp32: log2(n) butterflies of
    elementwise adds, each output's sums in one fixed order whatever x's other dims (no GEMM's blocking)."""
    n, h = x.shape[-1], 1
    x = x.float()
    while h < n:
        y = x.unflatten(-1, (-1, 2, h))
        a, b = y.select(-2, 0), y.select(-2, 1)
        x = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return x * (1.0 / n**0.5)  # exact for n a power of four (64); one fp32 rounding otherwise


def rotate(x: torch.Tensor) -> torch.Tensor:
    """R x (fp32) for heads x (..., head_dim): the stored basis. R = H diag(signs) is orthonormal."""
    return hadamard(x.float() * _signs(x.shape[-1], x.device)) if rotates(x.shape[-1]) else x.float()


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """R^T y (fp32): back to the model's basis (H is symmetric)."""
    return hadamard(y) * _signs(y.shape[-1], y.device) if rotates(y.shape[-1]) else y.float()


def into_stored(x: torch.Tensor, cache) -> torch.Tensor:
    """Queries (..., head_dim) into the basis of the pool's keys, in x's dtype (x itself for a float pool)."""
    return rotate(x).to(x.dtype) if _rotated(cache) else x


def from_stored(y: torch.Tensor, cache) -> torch.Tensor:
    """Attention output (..., head_dim) over the pool's values back to the model's basis (y for a float pool)."""
    return unrotate(y).to(y.dtype) if _rotated(cache) else y


def _rotated(cache) -> bool:
    return cache is not None and cache.dtype == torch.int8 and rotates(cache.shape[-1])


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


def encode(x: torch.Tensor):
    """What an int8 pool stores of heads x (..., head_dim): codes and scales of x rotated (quantize(rotate(x)))."""
    return quantize(rotate(x))


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """encode()'s inverse: heads in the model's basis, in dtype."""
    return unrotate(dequantize(codes, scales, torch.float32)).to(dtype)


def scales_of(cache_k: torch.Tensor, scales: Scales) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(keys' scales, values' scales): an int8 pool's, which it cannot be read or written without."""
    if cache_k.dtype == torch.int8 and scales is None:
        raise ValueError("an int8 KV pool needs its scales (keys', values'): pass the layer's cache_k_scales and "
                         "cache_v_scales")
    return (None, None) if scales is None else scales


def write(cache: torch.Tensor, scales: Optional[torch.Tensor], blocks, offsets, x: torch.Tensor) -> None:
    """x into the pool at (blocks, offsets): an int8 pool's codes into cache, their scales into scales."""
    if cache.dtype == torch.int8:
        codes, scale = encode(x)
        cache[blocks, :, offsets] = codes
        scales[blocks, :, offsets] = scale
    else:
        cache[blocks, :, offsets] = x.to(cache.dtype)


def store(cache_k: torch.Tensor, cache_v: torch.Tensor, table: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          positions: torch.Tensor, scales: Scales = None) -> None:
    """Write keys/values (B, T, kv_heads, head_dim) at positions (B or 1, T) of the table's rows."""
    B, T = k.shape[:2]
    bs = cache_k.shape[2]
    pos = positions.expand(B, T)
    blocks = table.gather(1, pos // bs)  # (B, T)
    scales_k, scales_v = scales_of(cache_k, scales)
    write(cache_k, scales_k, blocks, pos % bs, k)
    write(cache_v, scales_v, blocks, pos % bs, v)


def read(cache_k: torch.Tensor, cache_v: torch.Tensor, table: torch.Tensor, kv_len: int, dtype=None,
         stored: bool = False, scales: Scales = None):
    """Keys and values (B, kv_heads, kv_len, head_dim) of positions 0..kv_len-1 of the table's rows (a gather);
    an int8 pool's dequantized to dtype, in the model's basis (stored=True: the pool's, as attending() uses)."""
    bs = cache_k.shape[2]
    table = table[:, : -(-kv_len // bs)]
    out = []
    for cache, scale in zip((cache_k, cache_v), scales_of(cache_k, scales)):
        g = cache[table]  # (B, blocks, kv_heads, block_size, head_dim)
        if cache.dtype == torch.int8:
            g = (dequantize if stored else decode)(g, scale[table], dtype)
        g = g.transpose(1, 2)
        out.append(g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])[:, :, :kv_len])
    return out


def attending(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, table: torch.Tensor, kv_len: int,
              scales: Scales = None):
    """(keys, values, queries) for attention over the pool, in the basis its keys and values are stored in: an int8
    pool's as dequantized, q (B, T, heads, head_dim) rotated into it; the output then goes through from_stored()."""
    keys, values = read(cache_k, cache_v, table, kv_len, q.dtype, stored=True, scales=scales)
    return keys, values, into_stored(q, cache_k)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: Optional[float] = None) -> torch.Tensor:
    """Attention of one query per row, written out so Inductor fuses it (SDPA is an opaque ~50 us call per layer):
    the compiled decode step's, over the keys and values attending() or a slot cache gives.

    q (B, 1, H, D); keys/values (B, Hkv, S, D); mask (B, 1, 1, S) bool. Query heads that share a KV head are
    grouped instead of repeating keys. Scores and softmax in fp32; scale None is D ** -0.5. Returns (B, H, 1, D).
    """
    (B, _, H, D), kv_heads = q.shape, keys.shape[1]
    qg = q.view(B, kv_heads, H // kv_heads, D).float()  # head h uses KV head h // (H / Hkv), as enable_gqa does
    scores = (qg @ keys.float().transpose(-1, -2)) * (D**-0.5 if scale is None else scale)  # (B, Hkv, G, S)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ values.float()).to(q.dtype).view(B, H, 1, D)


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
