"""Group-wise 4-bit weights ("int4"): every run of `group_size` input weights of an output row gets its own scale and
offset, so a weight costs 4 bits plus 32 bits per group (5 bits at group 32, 7B: ~4.1 GB; 4.5 bits at group 64,
llama.cpp q4_0's size).

Scheme: asymmetric, like llama.cpp's q4_1 (q4_0 is the symmetric variant with no offset): per group,
w ~= (code - 8) * scale + zero, codes 0..15. The (scale, zero) pair is searched per group: round-to-nearest over
[min, max] (scale = (max - min) / 15) and a few least-squares fits to codes from slightly stretched or clipped
grids, keeping the pair with the least squared error, each weight weighted by its size (a cheap form of
llama.cpp's k-quant search). Scale and zero are rounded to bf16 before the codes are chosen, so the codes fit the
values actually applied.

Kernels, measured in benchmarks/quant_kernels.py (docs/performance.md):
- ours (llama/kernels/cpu.py, x86 with AVX2, input size a multiple of 32): multiplies the storage layout as it is,
  with activations quantized to int8 in blocks of 32 as llama.cpp's q4_0/q4_1 do, so no repacking at load. The
  layer then holds the storage layout, its method Int4(group_size, out_features, ours=True). A prefill of more
  than 32 rows, where oneDNN has bf16 dot products, dequantizes the weight to bf16 a slice at a time for oneDNN's
  GEMM instead.
- otherwise torch.ops.aten._weight_int4pack_mm_for_cpu (PyTorch's CPU int4 GEMM) on weights packed once by
  aten._convert_weight_to_int4pack_for_cpu; bf16 activations. It needs the output size to be a multiple of 16 and
  the group size one of 32, 64, 128, 256 dividing the input size: other layers are padded (zero rows and columns,
  whose products are dropped). The layer's method is then Int4(group_size, out_features, ours=False).

Two layouts:
- storage (checkpoints, llama/formats/quantized_checkpoint.py, and our kernel): codes (N, K/2) uint8, two per byte (even k in
  the low nibble), and scales (N, ceil(K/G), 2) as (scale, zero) pairs. Rows and whole groups slice like the float
  weight, so a checkpoint shards along the same dimensions as Meta's.
- aten's (in the model): weight = packed (N', K'/2) uint8 in the kernel's own interleaved order (not sliceable),
  scales = (K'/G, N', 2), N' and K' the padded sizes; the layer's out size is kept in its method.
"""

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from llama.kernels import cpu
from llama.kernels import fused_decode
from llama.layers import LinearMethod, linear_layers
from llama.quantization.int4_cuda import Int4Cuda, to_cuda_kernel

GROUP_SIZES = (32, 64, 128, 256)  # what the CPU kernel takes
DEFAULT_GROUP_SIZE = 32  # q4_0/q4_1's block size
_ROWS = 16  # the packed layout's row block: output sizes are padded to a multiple of it


def check_group_size(group_size) -> int:
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES} (the CPU int4 kernel's), got {group_size!r}")
    return group_size


# The search's candidates: code ranges of 15 + offset steps over a group's (max - min), so that positive offsets
# clip the extremes (llama.cpp's make_qkx2_quants walks a similar grid). Each is followed by a least-squares fit.
_RANGE_OFFSETS = (-0.3, 0.0, 0.3, 0.6)
# Weights quantized at a time: the search's fp32 temporaries (512 KB) stay in cache and under the 1 MB from which
# loading gives each allocation its own mapping (memory.freed_memory_returned): at 1 MB every temporary was
# page-faulted in afresh, 4x slower.
_CHUNK_ELEMENTS = 1 << 17
_GPU_CHUNK_ELEMENTS = 1 << 24  # on a GPU small chunks are launch-bound: a 7B model took minutes at 1 << 17


def quantize_codes(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                   scale_dtype: torch.dtype = torch.bfloat16) -> Tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float weight -> storage layout (codes (N, K/2) uint8, scales (N, ceil(K/G), 2) scale_dtype).

    Per group, the (scale, zero) with the least weighted squared error among round-to-nearest over [min, max] and a
    few weighted least-squares fits (`_search`): never worse than round-to-nearest by that measure. A last, partial
    group is searched on its own values.
    """
    check_group_size(group_size)
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"int4 weights need an even input size, got a ({n}, {k}) weight")
    full, tail = divmod(k, group_size)
    codes = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(n, full + (tail > 0), 2, dtype=scale_dtype, device=weight.device)
    chunk = max(1, (_CHUNK_ELEMENTS if weight.device.type == "cpu" else _GPU_CHUNK_ELEMENTS) // k)
    for r0 in range(0, n, chunk):
        rows = weight[r0 : r0 + chunk].float()
        parts = [rows[:, : full * group_size].reshape(rows.shape[0], full, group_size)]
        if tail:  # searched on its own values (padding would pull the fit toward zero)
            parts.append(rows[:, full * group_size :].reshape(rows.shape[0], 1, tail))
        q, pairs = [], []
        for w in parts:
            scale, zero = _search(w, scale_dtype)
            q.append(_codes(w, scale, zero).flatten(1))
            pairs.append(torch.cat([scale, zero], dim=2))
        q = torch.cat(q, dim=1)
        codes[r0 : r0 + chunk] = q[:, 0::2] | (q[:, 1::2] << 4)
        scales[r0 : r0 + chunk] = torch.cat(pairs, dim=1).to(scale_dtype)
    return codes, scales


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.round((w - zero) / scale + 8).clamp_(0, 15).to(torch.uint8)


def importance(w: torch.Tensor) -> torch.Tensor:
    """Per-weight weights of the search's squared error, per group of w (..., G): |w| plus the group's root mean
    square, as llama.cpp's k-quants weigh theirs without an importance matrix (large weights count more: an
    unweighted search clips them and lost perplexity on both models measured)."""
    return w.abs() + w.pow(2).mean(dim=-1, keepdim=True).sqrt()


def _search(w: torch.Tensor, scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per group of w (rows, groups, G): the fp32 values of the scale_dtype (scale, zero), each (rows, groups, 1),
    whose round-to-nearest codes reconstruct w with the least `importance`-weighted squared error."""
    lo, hi = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
    rng = hi - lo
    plain = (rng / 15).clamp_min(1e-12)  # round-to-nearest over [min, max]; a constant group: any scale, codes 8
    best = None
    imp = importance(w)
    sum_w = imp.sum(dim=2, keepdim=True)
    sum_x = (imp * w).sum(dim=2, keepdim=True)
    for offset in (None,) + _RANGE_OFFSETS:
        if offset is None:
            scale, low = plain, lo
        else:  # codes from a stretched or shrunk grid, then the scale and low end that fit them best
            l = ((w - lo) * ((15 + offset) / rng.clamp_min(1e-12))).round_().clamp_(0, 15)
            il = imp * l
            sum_l, sum_ll = il.sum(dim=2, keepdim=True), (il * l).sum(dim=2, keepdim=True)
            sum_xl = (il * w).sum(dim=2, keepdim=True)
            det = sum_w * sum_ll - sum_l * sum_l  # ~0 when every code is equal: no fit
            fit = det > 1e-6 * sum_w * sum_ll
            det = torch.where(fit, det, torch.ones_like(det))
            scale = torch.where(fit, ((sum_w * sum_xl - sum_x * sum_l) / det).clamp_min(1e-12), plain)
            low = torch.where(fit, (sum_ll * sum_x - sum_l * sum_xl) / det, lo)
        scale = scale.to(scale_dtype).float()
        zero = (low + 8 * scale).to(scale_dtype).float()
        err = _codes(w, scale, zero).float().sub_(8).mul_(scale).add_(zero).sub_(w).pow_(2).mul_(imp)
        err = err.sum(dim=2, keepdim=True)
        if best is None:
            best = err, scale, zero
        else:
            better = err < best[0]
            best = (torch.where(better, err, best[0]), torch.where(better, scale, best[1]),
                    torch.where(better, zero, best[2]))
    return best[1], best[2]


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Storage codes (N, K/2) -> (N, K) uint8 values 0..15."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).view(codes.shape[0], -1)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 (N, K) weight a storage-layout int4 weight stands for."""
    q = unpack_codes(codes).float()
    n, k = q.shape
    groups = scales.shape[1]
    q = F.pad(q, (0, groups * group_size - k)).view(n, groups, group_size)
    s = scales.float()
    return ((q - 8) * s[..., 0:1] + s[..., 1:2]).view(n, -1)[:, :k]


def own_kernel(inputs: int) -> bool:
    """Whether a CPU int4 layer with this input size runs in our kernel (on the storage layout)."""
    return cpu.takes(inputs)


def kernel_shapes(rows: int, inputs: int, group_size: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Shapes of the layout (weight, scales) a (rows, inputs) int4 layer holds in the model."""
    if own_kernel(inputs):
        return (rows, inputs // 2), (rows, math.ceil(inputs / group_size), 2)
    n_pad, groups = -(-rows // _ROWS) * _ROWS, math.ceil(inputs / group_size)
    return (n_pad, groups * group_size // 2), (groups, n_pad, 2)


def to_kernel(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Storage layout -> aten's layout (packed (N', K'/2) uint8, scales (K'/G, N', 2)), padded as its kernel needs."""
    n, k = codes.shape[0], codes.shape[1] * 2
    groups = scales.shape[1]
    if groups != math.ceil(k / group_size):
        raise ValueError(f"int4 scales of shape {tuple(scales.shape)} do not fit a ({n}, {k}) weight with group size "
                         f"{group_size}")
    n_pad = -(-n // _ROWS) * _ROWS
    q = torch.full((n_pad, groups * group_size), 8, dtype=torch.int32)  # padding: code 8 times a zero scale
    torch.bitwise_and(codes, 15, out=q[:n, 0:k:2])
    torch.bitwise_right_shift(codes, 4, out=q[:n, 1:k:2])
    sz = F.pad(scales, (0, 0, 0, 0, 0, n_pad - n))  # padding rows: scale 0, zero 0
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, sz.transpose(0, 1).contiguous()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """x @ W.T for a kernel-layout int4 weight; bf16 (the scales' dtype) inside, result in x's dtype.

    Each row of x is multiplied on its own (a row's result never depends on the others of its batch).
    """
    k_pad, group_size = packed.shape[1] * 2, packed.shape[1] * 2 // scales.shape[0]
    rows = x.reshape(-1, x.shape[-1]).to(scales.dtype)
    if rows.shape[1] != k_pad:
        rows = F.pad(rows, (0, k_pad - rows.shape[1]))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group_size, scales)
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    return y.reshape(*x.shape[:-1], out_features).to(x.dtype)


def quantize_int4_weight(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE):
    """(N, K) float weight -> (packed, kernel scales): what benchmarks call int4_linear with."""
    codes, scales = quantize_codes(weight, group_size)
    return to_kernel(codes, scales, group_size)


class Int4(LinearMethod):
    """Group-wise int4 with `group_size` inputs per (scale, zero) pair and `out_features` local output rows: in our
    kernel on the storage layout (ours), or in aten's on its own padded layout."""

    quantized = True
    scheme = "int4"
    concatenates = False  # fuse before quantizing: aten's layout cannot be concatenated
    splits_state = False  # nor cut into rows: state_dict() keeps a fused int4 layer fused

    def __init__(self, group_size: int, out_features: int, ours: bool):
        self.group_size, self.out_features, self.ours = group_size, out_features, ours

    def hold(self, layer, weight: torch.Tensor, scales: torch.Tensor) -> None:
        layer.take(self, weight, scales)

    def apply(self, layer, x):
        if self.ours:
            return cpu.int4_linear(x, layer.weight, layer.scales, self.group_size)
        return int4_linear(x, layer.weight, layer.scales, self.out_features)

    def route(self, layer, rows, dtype):
        if not self.ours or cpu.onednn_rows(rows, cpu.QUANT_KERNEL_MAX_ROWS):
            return None
        return fused_decode.INT4, self.group_size, (layer.weight, layer.scales)

    def in_our_kernels(self, layer):
        return self.ours and layer.weight.device.type == "cpu"

    def __repr__(self) -> str:
        return f"Int4(group_size={self.group_size}, out_features={self.out_features}, ours={self.ours})"



def set_int4(layer: nn.Module, codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    """Make a Column/RowLinear an int4 layer from storage-layout codes and scales (on a CUDA device: tinygemm's)."""
    if codes.device.type == "cuda":
        Int4Cuda(group_size, codes.shape[0]).hold(layer, *to_cuda_kernel(codes, scales, group_size))
    elif own_kernel(codes.shape[1] * 2):
        Int4(group_size, codes.shape[0], True).hold(layer, codes.contiguous(), scales.contiguous())
    else:
        Int4(group_size, codes.shape[0], False).hold(layer, *to_kernel(codes, scales, group_size))


@torch.no_grad()
def quantize_int4(model: nn.Module, group_size: int = DEFAULT_GROUP_SIZE) -> nn.Module:
    """Quantize, in place, every linear layer of model to group-wise int4; return model.

    Call after model.fuse(): the packed layout cannot be concatenated afterwards. The embedding stays in the model
    dtype. Layers already quantized are left alone. Under model parallel each rank quantizes its own shard; a
    row-parallel shard's groups start at its first input, which are the full matrix's groups whenever the shard
    width is a multiple of group_size.
    """
    check_group_size(group_size)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))  # a model, or one of its layers
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantize='int4' runs on CPU and CUDA only (ours and tinygemm's kernels); the model is on "
                         f"{device}: use quantize='int8' there")
    for module in linear_layers(model):
        if not module.method.quantized:
            codes, scales = quantize_codes(module.weight, group_size)
            set_int4(module, codes, scales, group_size)
    return model
