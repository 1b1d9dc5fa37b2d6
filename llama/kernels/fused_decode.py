"""A decode step's transformer layers in one call of our CPU kernel (`llama_cpu::decode_layers`), eager.

Why: in an eager step the Python and PyTorch operators between two weight products run with the caches that the
weights streaming through have just flushed, and cost several times their warm time (docs/performance.md, "One call
per decode step"). The op runs every layer of the step with the same kernels, in the same order and with the same
roundings as model.TransformerBlock, so its result is the layer-by-layer result bit for bit; the model takes it
where every product of every layer would run in our kernels anyway (route() below mirrors quantize.product), and
goes layer by layer otherwise.

Gathering the op's arguments from the modules costs Python time on every layer, so they are kept per layer stack
and batch size, and forgotten whenever any module anywhere gets a parameter, buffer or submodule assigned
(PyTorch's global registration hooks: loading, quantizing, fusing and allocating a KV cache all do).
`LLAMA_FUSED_DECODE=0` turns it off (read on every step, so a benchmark can time both in one process:
`benchmarks/paired.py --layer-by-layer`).
"""

import weakref
from typing import List, Optional, Tuple

import torch
from torch.nn.modules import module as nn_module

from llama import settings
from llama.kernels import cpu as cpu_kernels
from llama.quantization import schemes as quantize

FLOAT, INT4, INT8 = 0, 1, 2  # the op's schemes: a bf16 or fp32 weight, group-wise int4, int8 with per-row scales


def route(linear, rows: int, dtype: torch.dtype) -> Optional[Tuple[int, int, Tuple[torch.Tensor, ...]]]:
    """(scheme, group size, tensors) when quantize.product(linear, x) of `rows` rows of `dtype` runs in our CPU
    kernel, else None. Must agree with quantize.product's routing: tests/kernels/test_fused_decode.py compares the two."""
    if linear.mp != 1 or linear.packed is not None:
        return None
    weight, scales = linear.weight, linear.scales
    if scales is not None and scales.dim() == 3:  # group-wise int4 (llama/quantization/int4.py)
        if not linear.int4_group or cpu_kernels.onednn_rows(rows, cpu_kernels.QUANT_KERNEL_MAX_ROWS):
            return None
        return INT4, linear.int4_group, (weight, scales)
    if getattr(linear, "int8_dynamic", False):
        if cpu_kernels.onednn_rows(rows, cpu_kernels.QUANT_KERNEL_MAX_ROWS):
            return None
        return INT8, 0, (weight, scales)
    if scales is not None or not cpu_kernels.takes_float(weight):
        return None
    if weight.dtype == torch.bfloat16:
        if dtype == torch.bfloat16 and cpu_kernels.onednn_rows(rows, quantize.BF16_KERNEL_MAX_ROWS):
            return None
        return FLOAT, 0, (weight,)
    if dtype == torch.float32 and rows <= quantize.FP32_KERNEL_MAX_ROWS:  # an fp32 weight
        return FLOAT, 0, (weight,)
    return None


def layer_inputs(layers, x: torch.Tensor):
    """The op's per-layer arguments (norms, eps, weights, schemes, groups, qkv_products, ffn_products, caches) for
    x (B, 1, dim), or None where any layer would not run entirely in our kernels."""
    B, dtype = x.shape[0], x.dtype
    norms: List[torch.Tensor] = []
    weights: List[torch.Tensor] = []
    caches: List[torch.Tensor] = []
    schemes: List[int] = []
    groups: List[int] = []
    eps, layout = None, None
    for block in layers:
        attention, ffn = block.attention, block.feed_forward
        for norm in (block.attention_norm, block.ffn_norm):
            if not cpu_kernels.norms(x, norm.weight) or eps not in (None, norm.eps):
                return None
            eps = norm.eps
            norms.append(norm.weight)
        if attention.cache_k is None or not cpu_kernels.attends(x, attention.cache_k):
            return None
        caches += (attention.cache_k, attention.cache_v)
        qkv = (attention.wq, attention.wk, attention.wv) if attention.wqkv is None else (attention.wqkv,)
        up = (ffn.w1, ffn.w3) if ffn.w13 is None else (ffn.w13,)
        if layout not in (None, (len(qkv), len(up))):
            return None
        layout = (len(qkv), len(up))
        for linear in (*qkv, attention.wo, *up, ffn.w2):
            r = route(linear, B, dtype)
            if r is None:
                return None
            schemes.append(r[0])
            groups.append(r[1])
            weights += r[2]
    if layout is None:
        return None
    return norms, eps, weights, schemes, groups, layout[0], layout[1], caches


_kept: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layers -> {(rows, dtype): layer_inputs()}


def _forget(*_) -> None:
    if _kept:
        _kept.clear()


for _register in (nn_module.register_module_parameter_registration_hook,
                  nn_module.register_module_buffer_registration_hook,
                  nn_module.register_module_module_registration_hook):
    _register(_forget)


def run(layers, h: torch.Tensor, cos, sin, positions, rows, kv_len: int) -> Optional[torch.Tensor]:
    """Every layer over h (B, 1, dim) in one call, as `for layer in layers: h = layer(h, ...)` computes it; None
    where the op cannot take them (the caller then goes layer by layer)."""
    if h.shape[1] != 1 or h.device.type != "cpu" or torch.compiler.is_compiling() or not cpu_kernels.available():
        return None
    if not settings.get().fused_decode:
        return None
    kept = _kept.setdefault(layers, {})
    key = (h.shape[0], h.dtype)
    if key not in kept:
        kept[key] = layer_inputs(layers, h)
    inputs = kept[key]
    if inputs is None:
        return None
    norms, eps, weights, schemes, groups, qkv_products, ffn_products, caches = inputs
    cos, sin, rows, row0, positions = cpu_kernels.attention_inputs(cos, sin, rows, positions)
    B = h.shape[0]
    out = torch.ops.llama_cpu.decode_layers(h.reshape(B, -1).contiguous(), norms, eps, weights, schemes, groups,
                                            qkv_products, ffn_products, cos, sin, caches, rows, row0, positions, kv_len)
    return out.view(B, 1, -1)
