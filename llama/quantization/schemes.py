"""The built-in quantization schemes (Llama.build's `quantize=`), registered by name: "int8" (weight-only),
"int8-dynamic" (int8 activations too, as llama.cpp's q8_0) and "int4" (group-wise). Each replaces the method of
every linear layer (llama/layers.py) with its own: llama/quantization/int8.py and int4.py hold the methods and their
arithmetic, llama/quantization/registry.py the QuantScheme objects and the registry (re-exported here: import this
module, which registers the built-ins, to register or look up a scheme).
"""

from typing import Optional, Union

import torch
from torch import nn

from llama.kernels import cpu
from llama.kernels import fused_decode
from llama.layers import Fusable, linear_layers, quantized
from llama.quantization.int4 import DEFAULT_GROUP_SIZE, check_group_size, quantize_int4
from llama.quantization.int8 import Int8WeightOnly, int8_dynamic, quantize_weight
from llama.quantization.registry import (  # noqa: F401  (the registry's public names, from here)
    QuantScheme,
    checked_group_size,
    choices,
    get,
    grouped,
    lookup,
    names,
    register,
    storable,
    unregister,
)
from llama.quantization.stored import Int4Stored, Int8Stored, fastest_int8  # noqa: F401


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


def activation_dtype(scheme: Union[str, QuantScheme, None]) -> Optional[torch.dtype]:
    """The activation dtype a scheme runs in when the caller names none (None: the device's default)."""
    scheme = lookup(scheme)
    return None if scheme is None else scheme.activation_dtype()


def quantize(model: nn.Module, scheme: Union[str, QuantScheme], group_size: Optional[int] = None) -> nn.Module:
    """Apply a quantization scheme (Llama.build's `quantize=`, a name or a QuantScheme); group_size is a grouped
    scheme's (int4's, default 32).

    Fuses q/k/v and gate/up first, as loading does (one product each; int4's layout cannot be concatenated later).
    """
    scheme = scheme if isinstance(scheme, QuantScheme) else get(scheme)
    group_size = checked_group_size(scheme, group_size)
    scheme.check_device(next((p.device for p in model.parameters()), torch.device("cpu")))
    for m in model.modules():
        if isinstance(m, Fusable):
            m.fuse()
    return scheme.quantize(model, scheme.group_size if group_size is None else group_size)


def _int4_activations() -> Optional[torch.dtype]:
    """PyTorch's int4 CPU kernel wants bf16; ours (llama/kernels/cpu.py) takes fp32, and on CPUs without native
    bf16 every other operator (norms, attention) runs faster in fp32 too, at twice the KV cache's bytes."""
    return None if cpu.available() else torch.bfloat16


def _bf16() -> torch.dtype:
    """PyTorch's int8 weight-only CPU kernel wants bf16 activations."""
    return torch.bfloat16


def _int8(model: nn.Module, group_size: None) -> nn.Module:
    return quantize_int8(model)


def _int8_dynamic(model: nn.Module, group_size: None) -> nn.Module:
    return quantize_int8_dynamic(model)


# Scales counted at 4 bytes each, as the memory check always has (int8's bf16 or fp32; int4's bf16 pair).
INT8 = register(QuantScheme("int8", _int8, weight_bits=8, scale_bytes=4, activation_dtype=_bf16,
                            storage=Int8Stored()))
INT8_DYNAMIC = register(QuantScheme("int8-dynamic", _int8_dynamic, weight_bits=8, scale_bytes=4, devices=("cpu",),
                                    stored_as="int8"))  # takes a stored int8 checkpoint's codes
INT4 = register(QuantScheme("int4", quantize_int4, weight_bits=4, scale_bytes=4, group_size=DEFAULT_GROUP_SIZE,
                            check_group_size=check_group_size, activation_dtype=_int4_activations,
                            devices=("cpu", "cuda"), storage=Int4Stored()))
SCHEMES = names()  # the built-in schemes' names (names() also has those registered since)
