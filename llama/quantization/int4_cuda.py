"""int4 on CUDA: PyTorch's tinygemm kernel (aten._weight_int4pack_mm), the one gpt-fast and torchao run.

Its dequantization per group, (code - 8) * scale + zero with bf16 (scale, zero), is the storage layout's
(llama/quantization/int4.py), so a stored int4 checkpoint or quantize="int4" gives the same weights on a GPU as on
the CPU; only the products' rounding differs (bf16 activations on tensor cores).

The kernel's layout, made once at load by aten._convert_weight_to_int4pack: codes (N', K'/2) uint8 with the even
input in the high nibble (ours keep it in the low one), N' a multiple of 8 and K' of 128 (8 inner k-tiles of 16)
and of the group size; scales (K'/G, N', 2). Padding is code 8 with scale and zero 0 (nothing), and padded inputs
are zeros, so padded groups add nothing either way.
"""

import math
from typing import Tuple

import torch
import torch.nn.functional as F

from llama.layers import LinearMethod

INNER_K_TILES = 8  # gpt-fast's choice: 16-byte loads per lane
_TILE_K = INNER_K_TILES * 16
_ROWS = 8


def to_cuda_kernel(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Storage layout on a CUDA device -> the kernel's (packed int32 tiles, scales (K'/G, N', 2) bf16)."""
    q, sz = kernel_inputs(codes, scales, group_size)
    return torch.ops.aten._convert_weight_to_int4pack(q, INNER_K_TILES), sz


def kernel_inputs(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """What the packer takes: padded codes (N', K'/2) uint8, even input in the high nibble, and scales
    (K'/G, N', 2) bf16. Any device (the tests check it on the CPU against the storage layout's dequantization)."""
    n, k = codes.shape[0], codes.shape[1] * 2
    groups = scales.shape[1]
    if groups != math.ceil(k / group_size) or scales.shape[0] != n:
        raise ValueError(f"int4 scales of shape {tuple(scales.shape)} do not fit a ({n}, {k}) weight with group size "
                         f"{group_size}")
    step = max(_TILE_K, group_size)
    k_pad, n_pad = -(-groups * group_size // step) * step, -(-n // _ROWS) * _ROWS
    q = torch.full((n_pad, k_pad // 2), 0x88, dtype=torch.uint8, device=codes.device)
    q[:n, : k // 2] = ((codes & 15) << 4) | (codes >> 4)  # the kernel reads the even input from the high nibble
    sz = torch.zeros((k_pad // group_size, n_pad, 2), dtype=torch.bfloat16, device=codes.device)
    sz[:groups, :n] = scales.transpose(0, 1).to(torch.bfloat16)
    return q, sz


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """x @ W.T on the kernel's layout; bf16 inside, the result in x's dtype. Rows are multiplied independently."""
    k_pad = packed.shape[1] * _TILE_K
    group_size = k_pad // scales.shape[0]
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if rows.shape[1] != k_pad:
        rows = F.pad(rows, (0, k_pad - rows.shape[1]))
    y = torch.ops.aten._weight_int4pack_mm(rows.contiguous(), packed, group_size, scales)
    return y[:, :out_features].reshape(*x.shape[:-1], out_features).to(x.dtype)


class Int4Cuda(LinearMethod):
    """Group-wise int4 in tinygemm's layout on a CUDA device (`out_features` local output rows)."""

    quantized = True
    scheme = "int4"
    concatenates = False  # the tiled layout cannot be concatenated: fuse before quantizing
    splits_state = False

    def __init__(self, group_size: int, out_features: int):
        self.group_size, self.out_features = group_size, out_features

    def hold(self, layer, weight: torch.Tensor, scales: torch.Tensor) -> None:
        layer.take(self, weight, scales)

    def apply(self, layer, x):
        return int4_linear(x, layer.weight, layer.scales, self.out_features)

    def __repr__(self) -> str:
        return f"Int4Cuda(group_size={self.group_size}, out_features={self.out_features})"
