"""Quantization schemes by name (Llama.build's `quantize=`): "int8" (weight-only), "int8-dynamic" (int8
activations too, as llama.cpp's q8_0) and "int4" (group-wise). Each replaces the method of every linear layer
(llama/layers.py) with its own: llama/quantization/int8.py and int4.py hold the methods and their arithmetic.
"""

from typing import Optional

import torch
from torch import nn

from llama.kernels import cpu as cpu_kernels
from llama.kernels import fused_decode
from llama.layers import Fusable, linear_layers, quantized
from llama.quantization.int4 import DEFAULT_GROUP_SIZE, quantize_int4
from llama.quantization.int8 import Int8WeightOnly, int8_dynamic, quantize_weight

SCHEMES = ("int8", "int8-dynamic", "int4")


@torch.no_grad()
def quantize_int8(model: nn.Module, scale_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Quantize, in place, every linear layer of model (attention, feed-forward, output) for "int8"; return model.

    The embedding stays in the model dtype (a lookup reads one row per token). Layers already quantized are left
    alone, so calling it twice is harmless.
    """
    for module in linear_layers(model):
        if not module.method.quantized:
            Int8WeightOnly().hold(module, *quantize_weight(module.weight, scale_dtype))
    return model


@torch.no_grad()
def quantize_int8_dynamic(model: nn.Module) -> nn.Module:
    """Quantize, in place, every linear layer for "int8-dynamic": int8 weights and fp32 scales, for our kernel
    (Int8Dynamic) or prepacked for oneDNN (Int8DynamicOneDNN).

    Layers already "int8" (a stored int8 checkpoint) keep their codes: the two schemes quantize weights alike.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        raise ValueError(f"quantize='int8-dynamic' needs a CPU with oneDNN (the model is on {device}): use "
                         "quantize='int8' there")
    for module in linear_layers(model):
        method = module.method
        if not method.quantized:
            q, scales = quantize_weight(module.weight, torch.float32)
        elif isinstance(method, Int8WeightOnly):
            q, scales = module.weight.data, module.scales.data.float()
        else:
            continue  # int8-dynamic already, or another scheme's layer
        int8_dynamic(q.shape[1]).hold(module, q, scales)
    return model


def fastest_int8(device) -> str:
    """The int8 scheme a stored int8 checkpoint loads as when the caller names none: "int8-dynamic" on a CPU where
    our kernels run (1.64x llama.cpp's q8_0 at 7B, against 0.8x weight-only: docs/performance.md), else "int8"
    (CUDA, or no AVX2 kernels: weight-only, as oneDNN's int8-dynamic is no faster there)."""
    return "int8-dynamic" if torch.device(device).type == "cpu" and cpu_kernels.available() else "int8"


@torch.no_grad()
def cast_floating(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the parameters like model.to(dtype), but leave quantization scales alone (their dtype is the kernel's),
    and never widen the embedding table of a quantized model: a lookup reads one row per token, so a bf16 table
    under fp32 activations costs nothing in speed and saves half its bytes (the model casts the rows it reads)."""
    is_quantized = quantized(model)
    for path, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if is_quantized and path.endswith("tok_embeddings") and p.element_size() < torch.empty((), dtype=dtype).element_size():
                continue
            if name != "scales" and p.is_floating_point() and p.dtype != dtype:
                setattr(module, name, nn.Parameter(p.to(dtype), requires_grad=p.requires_grad))
    fused_decode.forget()
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
