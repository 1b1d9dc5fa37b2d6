"""Row-invariant products at GEMM speed, for prefix_cache="exact" (llama/kernels/invariant.py): oneDNN's GEMM always
called on tiles of exactly TILE rows, the last one padded with zero rows.

oneDNN picks its blocking, and so each row's order of summation, by the problem's shape: the same row gives other
bits at 38 rows than at 32. At one fixed shape it gives a row the same bits at any place in the tile and beside any
other rows (measured on this machine for bf16 and fp32 at 64x172 up to 5632x2048; tests/kernels/test_tiled.py). So
a prefill of any length, a chunk, and a decode step of any batch give every row the same bits when every product
runs in TILE-row tiles. Our float_linear is row-invariant by construction but, built for decode's few rows, takes a
512-row bf16 prefill about 20x as long as oneDNN's AMX GEMM (docs/performance.md, "exact"). A decode step pays for
a whole tile (its rows padded to TILE).

Because invariance is measured, not proved, each weight shape is checked once per process before its first tiled
product (probe): a tile of random rows against the same rows in another order, beside other rows, and alone among
zeros. A shape that fails runs in our float_linear for the rest of the process, every row count alike.
"""

from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from llama.kernels import cpu
from llama.kernels import invariant

TILE = 32  # rows per oneDNN call (docs/performance.md, "exact")
# Smaller weights stay in our kernel: their products cost little in a prefill, and a tile's fixed cost per call
# (oneDNN reorders the weight) would slow every decode step (stories260K: 6x).
MIN_ELEMENTS = 1 << 18
enabled = True  # False: every row-invariant product in our kernel, as before tiles (benchmarks compare the two)
_probed: Dict[Tuple[int, int, torch.dtype], bool] = {}


def _gemm(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")
    return F.linear(rows, weight)


def _dtype_ok(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """bf16 weights and activations where oneDNN has bf16 dot products; fp32 ones where this build has its fp32
    linear. Others stay in our kernel (oneDNN's widening bf16 path is slower than ours at every size)."""
    if weight.device.type != "cpu" or weight.dtype != dtype or weight.dim() != 2 or not weight.is_contiguous():
        return False
    if dtype == torch.bfloat16:
        return cpu.onednn_bf16()
    return dtype == torch.float32 and torch.backends.mkldnn.is_available() \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def probe(weight: torch.Tensor) -> bool:
    """Whether oneDNN gives every row of a TILE-row product of this weight's shape the same bits wherever it sits."""
    key = (weight.shape[0], weight.shape[1], weight.dtype)
    if key not in _probed:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2 * TILE, weight.shape[1], generator=g).to(weight.dtype)
        w = torch.randn(weight.shape, generator=g).to(weight.dtype)  # the shape's, not the weight's, behaviour
        y = _gemm(x[:TILE], w)
        moved = _gemm(torch.cat([x[TILE + 1 :], x[:1]]), w)[-1]  # row 0 last, beside other rows
        alone = torch.zeros(TILE, weight.shape[1], dtype=weight.dtype)
        alone[TILE // 2] = x[1]
        ok = torch.equal(_gemm(x[:TILE].flip(0), w), y.flip(0)) and torch.equal(moved, y[0]) \
            and torch.equal(_gemm(alone, w)[TILE // 2], y[1])
        _probed[key] = ok
    return _probed[key]


def takes(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether x @ weight.T of activations in dtype runs in tiles (while row-invariant arithmetic is on): not for
    weights under MIN_ELEMENTS, nor the logits product (invariant.logits), whose rows are few in prefill and decode
    alike. Any rule that does not look at the row count keeps every row's arithmetic the same."""
    return enabled and weight.numel() >= MIN_ELEMENTS and not torch.compiler.is_compiling() \
        and not invariant.in_logits() and _dtype_ok(weight, dtype) and probe(weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in TILE-row oneDNN calls; result in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    M = rows.shape[0]
    out = torch.empty(M, weight.shape[0], dtype=x.dtype)
    for m0 in range(0, M, TILE):
        part = rows[m0 : m0 + TILE]
        if part.shape[0] < TILE:
            part = torch.cat([part, part.new_zeros(TILE - part.shape[0], part.shape[1])])
        out[m0 : m0 + TILE] = _gemm(part.contiguous(), weight)[: min(TILE, M - m0)]
    return out.view(*x.shape[:-1], weight.shape[0])
