"""The unquantized product x @ W.T of a bf16 or fp32 linear layer: our CPU kernel where it is fastest, else oneDNN
or PyTorch's. Every linear layer's default method (llama/layers.py, Unquantized) multiplies here."""

import torch
import torch.nn.functional as F

from llama.kernels import cpu
from llama.kernels import invariant, tiled

# oneDNN's fp32 linear, when this build has it: eager F.linear runs MKL's sgemm for fp32 on CPU, which is slower at
# every batch size measured (docs/performance.md; bf16 already goes to oneDNN).
ONEDNN_FP32 = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# fp32 products of at most this many rows run in our kernel (it reads the weights at the memory's rate); larger ones
# are compute-bound and oneDNN's GEMM is faster there (docs/performance-history.md, "Why these defaults").
FP32_KERNEL_MAX_ROWS = 8
# The same for bf16 activations and weights, eager, where oneDNN has the CPU's own bf16 dot products
# (cpu.onednn_bf16()): past this many rows (a prompt's prefill) its GEMM is faster than our kernel. Without
# them it widens to fp32 and is slower at every size, so our kernel takes every bf16 product.
BF16_KERNEL_MAX_ROWS = 16


def ours(weight: torch.Tensor, rows: int, dtype: torch.dtype) -> bool:
    """Whether x @ weight.T of `rows` rows of `dtype` runs in our float_linear: the one routing rule that linear()
    follows and fused_decode.route() reports. bf16 weights always (except a bf16 prefill past BF16_KERNEL_MAX_ROWS,
    eager, where oneDNN has bf16 dot products), fp32 ones up to FP32_KERNEL_MAX_ROWS rows of fp32; at any row count
    while row-invariant arithmetic is on (llama/kernels/invariant.py: oneDNN's GEMM blocks by the row count), except
    where oneDNN's GEMM in fixed tiles takes the product (llama/kernels/tiled.py)."""
    if not cpu.takes_float(weight) or (invariant.active() and tiled.takes(weight, dtype)):
        return False
    if weight.dtype == torch.bfloat16:
        return invariant.active() or not (dtype == torch.bfloat16 and cpu.onednn_rows(
            rows, BF16_KERNEL_MAX_ROWS) and not torch.compiler.is_compiling())
    return dtype == torch.float32 and (rows <= FP32_KERNEL_MAX_ROWS or invariant.active())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for an unquantized weight.

    On CPU bf16 goes to our kernel (oneDNN's streams more slowly, and without native bf16 its GEMM costs a whole
    GEMV per row), as does fp32 up to a few rows (a GEMV); larger fp32 batches go to oneDNN's GEMM eagerly, to
    Inductor's choice compiled. The same inside torch.compile: a compiled step then calls our kernel on the model's
    own weights instead of freezing a copy into its graph.
    """
    if x.device.type == "cpu":
        if invariant.active() and tiled.takes(weight, x.dtype):  # row-invariant at GEMM speed
            return tiled.linear(x, weight)
        if ours(weight, x.numel() // x.shape[-1], x.dtype):
            return cpu.float_linear(x, weight)
        if weight.dtype == torch.float32 and x.dtype == torch.float32 and ONEDNN_FP32 \
                and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)  # bf16 on CPU: oneDNN's bf16 GEMM
