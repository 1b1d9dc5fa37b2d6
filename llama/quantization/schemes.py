"""Quantized linear layers. Group-wise 4-bit ("int4") lives in llama/quantization/int4.py; this module is int8 (int8
weights with one scale per output channel, two ways to multiply) and the dispatch between them.

Decoding reads every weight once per token, so halving the bytes (vs bf16) nearly doubles batch-1 speed.

- "int8" (weight-only): activations stay floating point. On CPU the product runs in
  torch.ops.aten._weight_int8pack_mm, which is fast only with bf16 activations, so the scales are bf16 and
  activations are cast to bf16 around it. On CUDA it is gpt-fast's dequantize-then-multiply, which compiled
  decoding turns into one fused kernel.
- "int8-dynamic" (CPU): activations are also quantized to int8 on the fly and multiplied by the int8 weights in
  integers, as llama.cpp's q8_0 does. With our kernels (llama/kernels/cpu.py, x86 with AVX2) activations are
  quantized in blocks of 32 with one scale each, exactly q8_0's activation scheme, and the weights stay plain int8
  (so a stored "int8" checkpoint loads as int8-dynamic too). Without them the product runs in oneDNN's int8 GEMM
  on prepacked weights with one activation scale per row (7-bit codes without VNNI). Either way a row's result
  never depends on the other rows of its batch. A prefill of more than 32 rows, where oneDNN has bf16 dot
  products, multiplies the weight dequantized to bf16 in oneDNN's GEMM instead (cpu_kernels.int8_linear: faster
  there, and bf16 activations are closer to fp32 than int8 blocks). Accuracy: docs/performance.md.

Both are symmetric, per-output-channel, round-to-nearest: q8_0's scheme with one scale per row instead of per
32 values. Under model parallel each rank quantizes its own shard: a column-parallel shard holds whole output
rows (same result as quantizing the full matrix), a row-parallel shard gets scales over its input slice, and its
partial sums are still added by the all-reduce.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import nn

from llama.kernels import cpu as cpu_kernels
from llama.layers import Fusable
from llama.quantization.int4 import DEFAULT_GROUP_SIZE, int4_layer_linear, quantize_int4

SCHEMES = ("int8", "int8-dynamic", "int4")


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


def product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T for a (possibly quantized) Column/RowLinear's local weight."""
    if layer.packed is not None:
        return dynamic_int8_linear(x, layer.packed, layer.scales, layer.zero_points)
    if layer.scales is not None and layer.scales.dim() == 3:  # group-wise int4 (llama/quantization/int4.py)
        return int4_layer_linear(layer, x)
    if getattr(layer, "int8_dynamic", False):  # int8-dynamic in our kernel
        return cpu_kernels.int8_linear(x, layer.weight, layer.scales)
    return linear(x, layer.weight, layer.scales)


# oneDNN's fp32 linear, when this build has it: eager F.linear runs MKL's sgemm for fp32 on CPU, which is slower at
# every batch size measured (docs/performance.md; bf16 already goes to oneDNN).
ONEDNN_FP32 = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# fp32 products of at most this many rows run in our kernel (it reads the weights at the memory's rate); larger ones
# are compute-bound and oneDNN's GEMM is faster there (docs/performance.md, "Why these defaults").
FP32_KERNEL_MAX_ROWS = 8
# The same for bf16 activations and weights, eager, where oneDNN has the CPU's own bf16 dot products
# (cpu_kernels.onednn_bf16()): past this many rows (a prompt's prefill) its GEMM is faster than our kernel. Without
# them it widens to fp32 and is slower at every size, so our kernel takes every bf16 product.
BF16_KERNEL_MAX_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, scales=None) -> torch.Tensor:
    """x @ weight.T; with scales, weight is int8 with one scale per output row ("int8").

    Unquantized on CPU: our kernel or oneDNN (below). The int8 kernel needs in_features % 16 == 0 (other widths
    give wrong results or crash), so tiny layers dequantize the weight first instead (scaling after the product
    would be turned back into the same kernel by Inductor's patterns).
    """
    if scales is None:
        if x.device.type == "cpu":
            # On CPU bf16 goes to our kernel (oneDNN's streams more slowly, and without native bf16 its GEMM costs
            # a whole GEMV per row), as does fp32 up to a few rows (a GEMV); larger fp32 batches go to oneDNN's
            # GEMM eagerly, to Inductor's choice compiled. The same inside torch.compile: a compiled step then
            # calls our kernel on the model's own weights instead of freezing a copy into its graph.
            if weight.dtype == torch.bfloat16 and cpu_kernels.takes_float(weight):
                if x.dtype == torch.bfloat16 and cpu_kernels.onednn_takes(x, BF16_KERNEL_MAX_ROWS):
                    return F.linear(x, weight)  # oneDNN's bf16 GEMM
                return cpu_kernels.float_linear(x, weight)
            if weight.dtype == torch.float32 and x.dtype == torch.float32:
                if x.numel() <= FP32_KERNEL_MAX_ROWS * x.shape[-1] and cpu_kernels.takes_float(weight):
                    return cpu_kernels.float_linear(x, weight)
                if ONEDNN_FP32 and not torch.compiler.is_compiling():
                    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        return F.linear(x, weight)
    if weight.shape[1] % 16:
        return F.linear(x, weight.to(x.dtype) * scales[:, None].to(x.dtype))
    if x.device.type != "cpu":
        # gpt-fast's form: eager it converts the weight per call; compiled, Inductor fuses the conversion into
        # its matrix-vector kernel, so the int8 bytes are all that is read (the packed kernel is CPU/MPS only).
        return F.linear(x, weight.to(x.dtype)) * scales.to(x.dtype)
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(scales.dtype), weight, scales)
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def _has_int8_dot_product() -> bool:
    """Whether this CPU has VNNI (or AMX) int8 dot products. Without them, oneDNN multiplies uint8 by int8 with
    AVX2's vpmaddubsw, which adds pairs of products into saturating int16: full-range codes overflow it."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_kernels.cpu_flags())


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


def linear_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def float_kernel_model(model: nn.Module) -> bool:
    """Whether every linear layer is an unquantized CPU weight our float_linear takes (llama/kernels/cpu.py)."""
    return all(m.scales is None for m in linear_layers(model)) and kernel_model(model)


def kernel_model(model: nn.Module) -> bool:
    """Whether every linear layer runs in our CPU kernels (float_linear, int4 in its storage layout, int8-dynamic
    on plain int8 weights), so that a compiled step can call them on the model's own tensors (llama/compilation/compiled_decode.py)."""
    def ours(m) -> bool:
        if m.packed is not None or m.weight.device.type != "cpu":
            return False
        if m.scales is None:
            return cpu_kernels.takes_float(m.weight)
        if m.scales.dim() == 3:
            return getattr(m, "int4_group", None) is not None
        return getattr(m, "int8_dynamic", False)
    return all(ours(m) for m in linear_layers(model))


@torch.no_grad()
def quantize_int8(model: nn.Module, scale_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Quantize, in place, every linear layer of model (attention, feed-forward, output) for "int8"; return model.

    The embedding stays in the model dtype (a lookup reads one row per token). Layers already quantized are left
    alone, so calling it twice is harmless.
    """
    for module in linear_layers(model):
        if module.scales is None:
            q, scales = quantize_weight(module.weight, scale_dtype)
            module.weight = nn.Parameter(q, requires_grad=False)
            module.scales = nn.Parameter(scales, requires_grad=False)
    return model


@torch.no_grad()
def quantize_int8_dynamic(model: nn.Module) -> nn.Module:
    """Quantize, in place, every linear layer for "int8-dynamic": int8 weights and fp32 scales, for our kernel or
    prepacked for oneDNN (then the prepacked copy replaces the weight, so the model holds each weight once).

    Layers already "int8" (a stored int8 checkpoint) keep their codes: the two schemes quantize weights alike.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        raise ValueError(f"quantize='int8-dynamic' needs a CPU with oneDNN (the model is on {device}): use "
                         "quantize='int8' there")
    for module in linear_layers(model):
        if module.packed is not None or getattr(module, "int8_dynamic", False):
            continue
        if module.scales is None:
            q, scales = quantize_weight(module.weight, torch.float32)
        elif module.scales.dim() == 1 and module.weight.dtype == torch.int8:
            q, scales = module.weight.data, module.scales.data.float()
        else:
            continue  # another scheme's layer
        if cpu_kernels.takes(q.shape[1]):
            module.weight = nn.Parameter(q, requires_grad=False)
            module.scales = nn.Parameter(scales, requires_grad=False)
            module.int8_dynamic = True
        else:
            module.packed = torch.ops.onednn.qlinear_prepack(q, None)
            module.scales = nn.Parameter(scales, requires_grad=False)
            module.zero_points = torch.zeros(q.shape[0], dtype=torch.int64)
            module.weight = None
    return model


@torch.no_grad()
def cast_floating(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the parameters like model.to(dtype), but leave quantization scales alone (their dtype is the kernel's),
    and never widen the embedding table of a quantized model: a lookup reads one row per token, so a bf16 table
    under fp32 activations costs nothing in speed and saves half its bytes (the model casts the rows it reads)."""
    quantized = any(getattr(m, "scales", None) is not None or getattr(m, "packed", None) is not None
                    for m in model.modules())
    for path, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if quantized and path.endswith("tok_embeddings") and p.element_size() < torch.empty((), dtype=dtype).element_size():
                continue
            if name != "scales" and p.is_floating_point() and p.dtype != dtype:
                setattr(module, name, nn.Parameter(p.to(dtype), requires_grad=p.requires_grad))
    return model


def activation_dtype(scheme: Optional[str]) -> Optional[torch.dtype]:
    """The activation dtype a scheme runs in when the caller names none (None: the device's default).

    PyTorch's int8/int4 CPU kernels want bf16; ours (llama/kernels/cpu.py) take fp32, and on CPUs without native
    bf16 every other operator (norms, attention) runs faster in fp32 too, at twice the KV cache's bytes."""
    if scheme == "int8" or (scheme == "int4" and not cpu_kernels.available()):
        return torch.bfloat16
    return None


def quantize(model: nn.Module, scheme: str, group_size: Optional[int] = None) -> nn.Module:
    """Apply a quantization scheme by name (Llama.build's `quantize=`); group_size is int4's (default 32).

    Fuses q/k/v and gate/up first, as loading does (one product each; int4's layout cannot be concatenated later).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"quantize must be one of {SCHEMES} or None, got {scheme!r}")
    if group_size is not None and scheme != "int4":
        raise ValueError(f"group_size applies to quantize='int4' only, got group_size={group_size!r} with {scheme!r}")
    for m in model.modules():
        if isinstance(m, Fusable):
            m.fuse()
    if scheme == "int4":
        return quantize_int4(model, DEFAULT_GROUP_SIZE if group_size is None else group_size)
    return quantize_int8(model) if scheme == "int8" else quantize_int8_dynamic(model)

