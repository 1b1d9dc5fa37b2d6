"""int8 weights with one scale per output channel, and the three ways a layer multiplies by them.

Decoding reads every weight once per token, so halving the bytes (vs bf16) nearly doubles batch-1 speed.

- Int8WeightOnly ("int8"): activations stay floating point. On CPU the product runs in
  torch.ops.aten._weight_int8pack_mm, which is fast only with bf16 activations, so the scales are bf16 and
  activations are cast to bf16 around it. On CUDA it is gpt-fast's dequantize-then-multiply, which compiled
  decoding turns into one fused kernel.
- "int8-dynamic" (CPU): activations are also quantized to int8 on the fly and multiplied by the int8 weights in
  integers, as llama.cpp's q8_0 does. Int8Dynamic, with our kernels (llama/kernels/cpu.py, x86 with AVX2):
  activations are quantized in blocks of 32 with one scale each, exactly q8_0's activation scheme, and the weights
  stay plain int8 (so a stored "int8" checkpoint loads as int8-dynamic too). Int8DynamicOneDNN, without them:
  oneDNN's int8 GEMM on prepacked weights with one activation scale per row (7-bit codes without VNNI). Either way
  a row's result never depends on the other rows of its batch. A prefill of more than 32 rows, where oneDNN has
  bf16 dot products, multiplies the weight dequantized to bf16 in oneDNN's GEMM instead (cpu.int8_linear:
  faster there, and bf16 activations are closer to fp32 than int8 blocks). Accuracy: docs/performance.md.

All are symmetric, per-output-channel, round-to-nearest: q8_0's scheme with one scale per row instead of per
32 values. Under model parallel each rank quantizes its own shard: a column-parallel shard holds whole output
rows (same result as quantizing the full matrix), a row-parallel shard gets scales over its input slice, and its
partial sums are still added by the all-reduce.
"""

from typing import Tuple

import torch
import torch.nn.functional as F

from llama.kernels import cpu
from llama.kernels import dense, fused_decode, invariant
from llama.layers import LinearMethod


def quantize_weight(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16,
                    chunk: int = 1 << 24) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (int8 weight, scales of shape (out,)) with weight ~= q * scales[:, None].

    The scale is rounded to scale_dtype before dividing, so the int8 values fit the scale actually applied.
    Rows are done about `chunk` values at a time, so the fp32 temporaries of a large (output) matrix stay bounded.
    """
    chunk_rows = max(1, chunk // max(weight.shape[1], 1))
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=scale_dtype, device=weight.device)
    for start in range(0, weight.shape[0], chunk_rows):
        w = weight[start : start + chunk_rows].float()
        amax = w.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(scale_dtype)
        q[start : start + chunk_rows] = torch.round(w / s.float()[:, None]).clamp_(-128, 127)
        scales[start : start + chunk_rows] = s
    return q, scales


def dequantize_weight(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ (weight * scales[:, None]).T for an int8 weight with one scale per output row ("int8").

    The int8 kernel needs in_features % 16 == 0 (other widths give wrong results or crash), so tiny layers
    dequantize the weight first instead (scaling after the product would be turned back into the same kernel by
    Inductor's patterns). aten's packed kernel sums each row alone (row-invariant at any row count,
    tests/core/worker/test_exact_quantized.py).
    """
    if weight.shape[1] % 16:  # row-invariant (llama/kernels/invariant.py): dense.linear's kernel at any row count
        dense_weight = weight.to(x.dtype) * scales[:, None].to(x.dtype)
        return dense.linear(x, dense_weight) if invariant.active() else F.linear(x, dense_weight)
    if x.device.type != "cpu":
        # gpt-fast's form: eager it converts the weight per call; compiled, Inductor fuses the conversion into
        # its matrix-vector kernel, so the int8 bytes are all that is read (the packed kernel is CPU/MPS only).
        return F.linear(x, weight.to(x.dtype)) * scales.to(x.dtype)
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(scales.dtype), weight, scales)
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scales=None) -> torch.Tensor:
    """x @ weight.T: the dense product (llama/kernels/dense.py) without scales, weight_only_linear with them."""
    return dense.linear(x, weight) if scales is None else weight_only_linear(x, weight, scales)


def _has_int8_dot_product() -> bool:
    """Whether this CPU has VNNI (or AMX) int8 dot products. Without them, oneDNN multiplies uint8 by int8 with
    AVX2's vpmaddubsw, which adds pairs of products into saturating int16: full-range codes overflow it."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu.cpu_flags())


# Activation codes are zero_point +- ACT_HALF_RANGE. 7 bits without VNNI (PyTorch's "reduce_range"): then a pair of
# products, 2 * 127 * 127, still fits in int16 and the integer sum stays exact.
ACT_HALF_RANGE = 127 if _has_int8_dot_product() else 63
ACT_ZERO_POINT = ACT_HALF_RANGE + 1


def quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (uint8 codes, fp32 scales (M, 1)): x ~= (codes - ACT_ZERO_POINT) * scales.

    Symmetric per row; an all-zero row gets the zero point and a tiny scale, never a division by zero.
    """
    xf = x.float()
    scales = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-20) / ACT_HALF_RANGE
    return (torch.round(xf / scales) + float(ACT_ZERO_POINT)).to(torch.uint8), scales


def dynamic_int8_linear(x, packed, scales, zero_points) -> torch.Tensor:
    """int8 activations (per-row dynamic scales) times prepacked int8 weights, in oneDNN; result in x's dtype.

    oneDNN applies one activation scale per call, so the rows' scales are applied to the fp32 output instead:
    sum_k (xq[m,k] - zero point) * q[n,k] is exact in int32, then times scales[n] (by oneDNN) and row_scales[m].
    """
    rows = x.reshape(-1, x.shape[-1])
    codes, row_scales = quantize_rows(rows)
    y = torch.ops.onednn.qlinear_pointwise(codes, 1.0, ACT_ZERO_POINT, packed, scales, zero_points, None, 1.0, 0,
                                           torch.float32, "none", [], "")
    return (y * row_scales).to(x.dtype).view(*x.shape[:-1], -1)


class Int8WeightOnly(LinearMethod):
    """"int8": int8 weight, bf16 scales (N,), floating-point activations (weight_only_linear)."""

    quantized = True
    scheme = "int8"

    def hold(self, layer, q: torch.Tensor, scales: torch.Tensor) -> None:
        layer.take(self, q, scales)

    def apply(self, layer, x):
        return weight_only_linear(x, layer.weight, layer.scales)


class Int8Dynamic(LinearMethod):
    """"int8-dynamic" in our kernel: plain int8 weight, fp32 scales (N,), activations in int8 blocks of 32 (an input
    size our kernel takes: cpu.takes)."""

    quantized = True
    scheme = "int8-dynamic"

    def hold(self, layer, q: torch.Tensor, scales: torch.Tensor) -> None:
        layer.take(self, q, scales)

    def apply(self, layer, x):
        return cpu.int8_linear(x, layer.weight, layer.scales)

    def route(self, layer, rows, dtype):
        if cpu.onednn_rows(rows, cpu.QUANT_KERNEL_MAX_ROWS):  # int8_linear's oneDNN prefill
            return None
        return fused_decode.INT8, 0, (layer.weight, layer.scales)

    def in_our_kernels(self, layer):
        return layer.weight.device.type == "cpu"


class Int8DynamicOneDNN(LinearMethod):
    """"int8-dynamic" without our kernel: oneDNN's prepacked copy replaces the weight (the layer holds each weight
    once: weight None, `packed` and `zero_points` buffers), activations quantized per row (dynamic_int8_linear)."""

    quantized = True
    scheme = "int8-dynamic"
    concatenates = False

    def hold(self, layer, q: torch.Tensor, scales: torch.Tensor) -> None:
        layer.take(self, None, scales, torch.ops.onednn.qlinear_prepack(q, None),
                   torch.zeros(q.shape[0], dtype=torch.int64))

    def apply(self, layer, x):
        return dynamic_int8_linear(x, layer.packed, layer.scales, layer.zero_points)

    def weight_tensor(self, layer):
        return layer.packed


def int8_dynamic(inputs: int) -> LinearMethod:
    """The int8-dynamic method for a layer of this input size: our kernel where it takes it, else oneDNN's."""
    return Int8Dynamic() if cpu.takes(inputs) else Int8DynamicOneDNN()
