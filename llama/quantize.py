"""int8 weight-only quantization: every linear layer's weight as int8 with one scale per output channel.

Decoding reads every weight once per token, so halving the bytes (vs bf16) nearly doubles batch-1 speed. The
product runs in torch.ops.aten._weight_int8pack_mm, which is fast only with bf16 activations, so the scales are
bf16 and `model.linear` casts activations to bf16 around it. Symmetric, per-output-channel, round-to-nearest:
the same scheme as llama.cpp's q8_0 but with one scale per row instead of per 32 values.

Under model parallel each rank quantizes its own shard: a column-parallel shard holds whole output rows (same
result as quantizing the full matrix), a row-parallel shard gets scales over its input slice, and its partial
sums are still added by the all-reduce.
"""

from typing import Tuple

import torch
from torch import nn

from .model import ColumnLinear, RowLinear

SCHEMES = ("int8",)


def quantize_weight(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (int8 weight, scales of shape (out,)) with weight ~= q * scales[:, None].

    The scale is rounded to scale_dtype before dividing, so the int8 values fit the scale actually applied.
    """
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(scale_dtype)
    q = torch.round(w / scales.float()[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, scales


def dequantize_weight(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


@torch.no_grad()
def quantize_int8(model: nn.Module, scale_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Quantize, in place, every ColumnLinear/RowLinear of model (attention, feed-forward, output); return model.

    The embedding stays in the model dtype (a lookup reads one row per token). Layers already quantized are left
    alone, so calling it twice is harmless.
    """
    for module in model.modules():
        if isinstance(module, (ColumnLinear, RowLinear)) and module.scales is None:
            q, scales = quantize_weight(module.weight, scale_dtype)
            module.weight = nn.Parameter(q, requires_grad=False)
            module.scales = nn.Parameter(scales, requires_grad=False)
    return model


def quantize(model: nn.Module, scheme: str) -> nn.Module:
    """Apply a quantization scheme by name (Llama.build's `quantize=`)."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantize must be one of {SCHEMES} or None, got {scheme!r}")
    return quantize_int8(model)
