"""A decode step's transformer layers in one call of our CPU kernel (`llama_cpu::decode_layers`), eager.

Why: in an eager step the Python and PyTorch operators between two weight products run with the caches that the
weights streaming through have just flushed, costing several times their warm time (docs/performance-history.md,
"One call per decode step"). The op runs every layer of the step with the same kernels, in the same order and with
the same roundings as model.TransformerBlock, so its result is the layer-by-layer result bit for bit; the model
takes it where every product of every layer would run in our kernels anyway (each layer's method says so: route()
below asks the rule its product follows, llama/layers.py), and goes layer by layer otherwise.

Gathering the op's arguments from the modules costs Python time on every layer, so they are kept per layer stack
and batch size, and forgotten by forget(), which whatever replaces the layers' tensors calls: a linear layer taking
new tensors or a method (quantizing, loading), fusing, casting and allocating a KV cache (Transformer.setup_rope).
Code that assigns a layer's tensors by hand after a step must call it too.
`LLAMA_FUSED_DECODE=0` turns it off (llama/settings.py; `benchmarks/paired.py --layer-by-layer` reloads the
settings to time both in one process).
"""

import weakref
from typing import List, Optional, Tuple

import torch

from llama import settings
from llama.kernels import cpu
from llama.kernels import dense, invariant

# the op's schemes: a bf16 or fp32 weight, group-wise int4, int8 with per-row scales, GGUF blocks with int8
# activation blocks (llama.cpp's), fp32 activations or int16 activation blocks (group: the ggml type)
FLOAT, INT4, INT8, GGUF, GGUF_FLOAT, GGUF_X16 = 0, 1, 2, 3, 4, 5


def route(linear, rows: int, dtype: torch.dtype) -> Optional[Tuple[int, int, Tuple[torch.Tensor, ...]]]:
    """(scheme, group size, tensors) when linear's product of `rows` rows of `dtype` runs in our CPU kernel, else
    None: its method's answer (llama/layers.py LinearMethod.route, the rule its apply() follows)."""
    if linear.mp != 1 or linear.bias is not None:  # a bias is added outside the op's products
        return None
    return linear.method.route(linear, rows, dtype)


def router_route(router, rows: int, dtype: torch.dtype) -> Optional[Tuple[int, int, Tuple[torch.Tensor, ...]]]:
    """An MoE router's product (llama/moe.py Router, dense.linear's rule) in the op's terms, else None."""
    return (FLOAT, 0, (router.weight,)) if dense.ours(router.weight, rows, dtype) else None


def ffn_linears(ffn) -> Optional[Tuple[list, int, int]]:
    """(the FFN's products in the op's order, gate/up products per FFN, experts) of a dense FFN or an MoE layer's
    (the router, then each expert's), or None where its experts are not all laid out alike or it routes otherwise."""
    if not hasattr(ffn, "experts"):
        up = (ffn.w1, ffn.w3) if ffn.w13 is None else (ffn.w13,)
        return [*up, ffn.w2], len(up), 0
    if ffn.moe.router != "softmax" or ffn.moe.scale_inputs or getattr(ffn, "shared_expert", None) is not None:
        return None  # the op routes as softmax top-k, with no expert every token takes
    linears, layout = [ffn.gate], None
    for expert in ffn.experts:
        up = (expert.w1, expert.w3) if expert.w13 is None else (expert.w13,)
        if layout not in (None, len(up)):
            return None
        layout = len(up)
        linears += [*up, expert.w2]
    return linears, layout, len(ffn.experts)


def layer_inputs(layers, x: torch.Tensor):
    """The op's per-layer arguments (norms, eps, weights, schemes, groups, qkv_products and ffn_products per layer,
    caches, the paged pool's block table (one for every layer), or None for a slot cache, head norms, expert counts,
    top_k, renormalize) for x (B, 1, dim), or None where any layer would not run entirely in our kernels. Layers may
    differ in whether q/k/v and gate/up are fused (a Q4_K_M file's Q6_K v stays apart from its Q4_K q and k in some
    layers: llama/formats/gguf_quants.py finish)."""
    B, dtype = x.shape[0], x.dtype
    norms: List[torch.Tensor] = []
    weights: List[torch.Tensor] = []
    caches: List[torch.Tensor] = []
    heads: List[torch.Tensor] = []
    schemes: List[int] = []
    groups: List[int] = []
    experts: List[int] = []
    qkv_products: List[int] = []
    ffn_products: List[int] = []
    eps, moe = None, None
    for block in layers:
        attention, ffn = block.attention, block.feed_forward
        for norm in (block.attention_norm, block.ffn_norm, attention.q_norm, attention.k_norm):
            if norm is None:
                continue
            if not cpu.norms(x, norm.weight) or eps not in (None, norm.eps):
                return None
            eps = norm.eps
            (heads if norm is attention.q_norm or norm is attention.k_norm else norms).append(norm.weight)
        if attention.cache_k is None or not cpu.attends(x, attention.cache_k):
            return None
        caches += (attention.cache_k, attention.cache_v)
        qkv = (attention.wq, attention.wk, attention.wv) if attention.wqkv is None else (attention.wqkv,)
        found = ffn_linears(ffn)
        if found is None:
            return None
        qkv_products.append(len(qkv))
        ffn_products.append(found[1])
        experts.append(found[2])
        moe = getattr(ffn, "moe", moe)
        for linear in (*qkv, attention.wo, *found[0]):
            r = router_route(linear, B, dtype) if linear is getattr(ffn, "gate", None) else route(linear, B, dtype)
            if r is None:
                return None
            schemes.append(r[0])
            groups.append(r[1])
            weights += r[2]
    if not qkv_products or (heads and len(heads) != len(norms)):
        return None
    return (norms, eps, weights, schemes, groups, qkv_products, ffn_products, caches, layers[0].attention.block_table,
            heads, experts if moe is not None else [], moe.top_k if moe is not None else 0,
            moe.renormalize if moe is not None else False)


_kept: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layers -> {(rows, dtype): layer_inputs()}


def forget() -> None:
    """Drop every kept argument list: called whenever a layer's tensors, method or KV cache change."""
    if _kept:
        _kept.clear()


def run(layers, h: torch.Tensor, cos, sin, positions, rows, kv_len: int) -> Optional[torch.Tensor]:
    """Every layer over h (B, 1, dim) in one call, as `for layer in layers: h = layer(h, ...)` computes it; None
    where the op cannot take them (the caller then goes layer by layer)."""
    if h.shape[1] != 1 or h.device.type != "cpu" or torch.compiler.is_compiling() or not cpu.available():
        return None
    if not settings.get().fused_decode or not invariant.one_call_decodes(h.shape[0]):
        return None
    kept = _kept.setdefault(layers, {})
    key = (h.shape[0], h.dtype, invariant.active())  # routes differ while row-invariant arithmetic is on
    if key not in kept:
        kept[key] = layer_inputs(layers, h)
    inputs = kept[key]
    if inputs is None:
        return None
    norms, eps, weights, schemes, groups, qkv_products, ffn_products, caches, table, heads, experts, top_k, norm = inputs
    blocks = layers[0].attention.blocks
    if table is not None and blocks is not None:
        blocks.direct()  # outside the runner: the pool's slot layout (llama/kernels/paged.py BlockTable)
    cos, sin, rows, row0, positions = cpu.attention_inputs(cos, sin, rows, positions)
    B = h.shape[0]
    out = torch.ops.llama_cpu.decode_layers(h.reshape(B, -1).contiguous(), norms, eps, weights, schemes, groups,
                                            qkv_products, ffn_products, cos, sin, caches, table, rows, row0, positions,
                                            kv_len, heads, experts, top_k, norm)
    return out.view(B, 1, -1)
