"""A decode step's layers in one call (llama/kernels/fused_decode.py, llama/csrc/decode_layers.cpp): bitwise the
layer-by-layer step in every scheme and layout it takes, and the layer-by-layer step wherever it does not."""

import hardware
import pytest
import torch
from test_model import random_model

from llama.kernels import cpu
from llama.kernels import dense, fused_decode
from llama.layers import Fusable, linear_layers
from llama.quantization.int4 import quantize_int4
from llama.quantization.schemes import quantize_int8, quantize_int8_dynamic

pytestmark = hardware.KERNELS

# dim and FFN width multiples of 32 (the quantized kernels' block); head_dim 16 (a multiple of 8)
SHAPE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, multiple_of=32)


# Qwen3-MoE's kind: qk-norm, a dense layer first, then layers of 4 experts of which each token takes 2
MOE = dict(qk_norm=True, moe=dict(n_experts=4, top_k=2, hidden_dim=64, dense_layers=[0]))


def model_in(scheme, fused, dtype=torch.float32, moe=False):
    model = random_model(seed=3, dtype=dtype, max_batch=4, **SHAPE, **(MOE if moe else {}))
    if fused == "mixed":  # layers that differ, as a Q4_K_M file's: some fuse q/k/v or gate/up, others do not
        for part in (model.layers[1].attention, model.layers[0].feed_forward, model.layers[2].feed_forward):
            for m in part.modules():  # an MoE layer's experts, each a FeedForward
                if isinstance(m, Fusable):
                    m.fuse()
    elif fused:
        model.fuse()
    if scheme == "int4":
        quantize_int4(model, 32)
    elif scheme == "int8-dynamic":
        quantize_int8_dynamic(model)
    elif scheme == "int8":
        quantize_int8(model)
    return model


# Each case: batch rows, then the forward call's start_pos and rows (the engine's forms: one shared position, a
# position per row with chosen cache rows, a group's consecutive rows as a slice).
CASES = {"one row": (1, 5, None), "rows and positions": (3, [5, 7, 6], [2, 0, 3]), "slice": (2, 5, slice(1, 3))}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scheme, dtype, fused", [
    ("none", torch.float32, False), ("none", torch.bfloat16, False), ("none", torch.bfloat16, True),
    ("int4", torch.float32, True), ("int4", torch.bfloat16, False), ("int8-dynamic", torch.float32, True),
    ("int8-dynamic", torch.float32, False), ("none", torch.float32, "mixed"), ("int4", torch.bfloat16, "mixed"),
])
def test_one_call_is_the_layer_by_layer_step(scheme, dtype, fused, case, monkeypatch, moe=False):
    """Logits and every cache write bitwise equal to the layer-by-layer step, and the op really ran."""
    B, start, rows = CASES[case]
    ran = []
    real_op = torch.ops.llama_cpu.decode_layers
    monkeypatch.setattr(fused_decode.torch.ops.llama_cpu, "decode_layers", lambda *a: ran.append(1) or real_op(*a),
                        raising=False)
    models = []
    for one_call in (True, False):
        model = model_in(scheme, fused, dtype, moe)
        cache_rows = range(4) if rows is None or isinstance(rows, slice) else rows
        for r in cache_rows:  # what earlier steps wrote, in every row the step reads
            prefill_row = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(r))
            model(prefill_row, 0, rows=torch.tensor([r]))
        if not one_call:  # what the model does where the op cannot take its layers
            monkeypatch.setattr(fused_decode, "run", lambda *a, **k: None)
        tokens = torch.randint(0, 96, (B, 1), generator=torch.Generator().manual_seed(7))
        start_pos = start if isinstance(start, int) else torch.tensor(start)
        row_arg = torch.tensor(rows) if isinstance(rows, list) else rows
        models.append((model, model(tokens, start_pos, rows=row_arg), model(tokens, start_pos, rows=row_arg)))
    assert len(ran) == 2  # the two steps of the one-call model; none after run() was replaced
    (a, logits_a, again_a), (b, logits_b, again_b) = models
    assert torch.equal(logits_a, logits_b) and torch.equal(again_a, again_b)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.attention.cache_k, lb.attention.cache_k)
        assert torch.equal(la.attention.cache_v, lb.attention.cache_v)


@pytest.mark.parametrize("case", ["one row", "rows and positions"])
@pytest.mark.parametrize("scheme, dtype, fused", [
    ("none", torch.float32, False), ("none", torch.bfloat16, True), ("int4", torch.float32, True),
    ("int8-dynamic", torch.float32, True), ("none", torch.float32, "mixed"),
])
def test_one_call_takes_qk_norm_and_experts(scheme, dtype, fused, case, monkeypatch):
    """The same for Qwen3-MoE's layers: qk-norm over each head, the router's top 2 of 4 experts (tokens grouped by
    expert, each row's outputs added in rank order), a dense layer among them."""
    test_one_call_is_the_layer_by_layer_step(scheme, dtype, fused, case, monkeypatch, moe=True)


def test_batch_rows_equal_solo_steps():
    """A batch's rows in one call equal each row stepped alone (batch == solo), int4 and bf16."""
    for scheme, dtype in (("int4", torch.float32), ("none", torch.bfloat16)):
        model = model_in(scheme, True, dtype)
        prompts = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(0))
        model(prompts, 0)
        caches = [(l.attention.cache_k.clone(), l.attention.cache_v.clone()) for l in model.layers]
        step = torch.randint(0, 96, (3, 1), generator=torch.Generator().manual_seed(1))
        batch = model(step, 6)
        for r in range(3):
            for layer, (k, v) in zip(model.layers, caches):
                layer.attention.cache_k.copy_(k)
                layer.attention.cache_v.copy_(v)
            solo = model(step[r : r + 1], torch.tensor([6]), rows=torch.tensor([r]))
            assert torch.equal(solo[0], batch[r]), (scheme, r)


def test_routes_follow_the_products(monkeypatch):
    """route() says 'our kernel' exactly where the layer's product calls it: a product that goes elsewhere (oneDNN past
    the row limits, PyTorch's int8 kernel, fp32 past a few rows) keeps the layer-by-layer step."""
    calls = []
    for name in ("float_linear", "int4_linear", "int8_linear"):
        real = getattr(torch.ops.llama_cpu, name)
        monkeypatch.setattr(torch.ops.llama_cpu, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a),
                            raising=False)
    cases = [("none", torch.float32, 1), ("none", torch.float32, dense.FP32_KERNEL_MAX_ROWS + 1),
             ("none", torch.bfloat16, 1), ("none", torch.bfloat16, dense.BF16_KERNEL_MAX_ROWS + 1),
             ("int4", torch.float32, 2), ("int4", torch.float32, cpu.QUANT_KERNEL_MAX_ROWS + 1),
             ("int8-dynamic", torch.float32, cpu.QUANT_KERNEL_MAX_ROWS + 1), ("int8", torch.bfloat16, 1)]
    for scheme, dtype, rows in cases:
        model = model_in(scheme, False, dtype)
        for linear in linear_layers(model.layers):
            x = torch.randn(rows, 1, linear.in_features).to(dtype)
            calls.clear()
            linear(x)
            ours = bool(calls)
            assert (fused_decode.route(linear, rows, dtype) is not None) == ours, (scheme, dtype, rows)


def test_falls_back_where_the_op_cannot_run(monkeypatch):
    """int8 (PyTorch's weight-only kernel) and prefills go layer by layer."""
    assert fused_decode.layer_inputs(model_in("int8", False, torch.bfloat16).layers,
                                     torch.zeros(1, 1, 64, dtype=torch.bfloat16)) is None
    model = model_in("none", False)
    x = torch.zeros(1, 1, 64)
    assert fused_decode.layer_inputs(model.layers, x) is not None
    assert fused_decode.run(model.layers, torch.zeros(1, 2, 64), None, None, None, None, 2) is None
    p = torch.tensor([[0]])
    assert fused_decode.run(model.layers, x, model.rope_cos[p], model.rope_sin[p], p, None, 1) is not None
    monkeypatch.setenv("LLAMA_FUSED_DECODE", "0")
    assert fused_decode.run(model.layers, x, model.rope_cos[p], model.rope_sin[p], p, None, 1) is None
    monkeypatch.delenv("LLAMA_FUSED_DECODE")
    monkeypatch.setattr(cpu, "available", lambda: False)  # LLAMA_CPU_KERNELS=0, or no AVX2 or compiler
    assert fused_decode.run(model.layers, x, model.rope_cos[p], model.rope_sin[p], p, None, 1) is None


def test_op_refuses_inconsistent_arguments():
    x = torch.zeros(1, 64)
    w = torch.zeros(64, 64)
    cache = torch.zeros(1, 2, 8, 16)
    args = dict(cos=torch.zeros(1, 8), sin=torch.zeros(1, 8), table=None, rows=None, row0=0,
                positions=torch.tensor([0]), kv_len=1, head_norms=[], experts=[], top_k=0, renormalize=False)
    op = torch.ops.llama_cpu.decode_layers
    with pytest.raises(RuntimeError, match="qkv_products must be 1 or 3"):
        op(x, [w[0], w[0]], 1e-5, [w] * 4, [0] * 4, [0] * 4, [2], [1], caches=[cache, cache], **args)
    with pytest.raises(RuntimeError, match="one qkv_products and one ffn_products per layer, got 2 and 1 for 1"):
        op(x, [w[0], w[0]], 1e-5, [w] * 4, [0] * 4, [0] * 4, [1, 1], [1], caches=[cache, cache], **args)
    with pytest.raises(RuntimeError, match="5 products for 1 layers, got 4 schemes"):
        op(x, [w[0], w[0]], 1e-5, [w] * 4, [0] * 4, [0] * 4, [1], [2], caches=[cache, cache], **args)
    with pytest.raises(RuntimeError, match="the schemes take 6 weight tensors, got 5"):
        op(x, [w[0], w[0]], 1e-5, [w] * 5, [0, 0, 0, 0, 1], [0] * 5, [1], [2], caches=[cache, cache], **args)
    moe = {**args, "experts": [4], "top_k": 2}  # an MoE layer: attention, the router, 4 experts of 2 products
    with pytest.raises(RuntimeError, match="11 products for 1 layers, got 4 schemes"):
        op(x, [w[0], w[0]], 1e-5, [w] * 4, [0] * 4, [0] * 4, [1], [1], caches=[cache, cache], **moe)
    with pytest.raises(RuntimeError, match="layer 0 has 4 experts for top_k 5"):
        op(x, [w[0], w[0]], 1e-5, [w] * 11, [0] * 11, [0] * 11, [1], [1], caches=[cache, cache], **{**moe, "top_k": 5})
    with pytest.raises(RuntimeError, match="no head norms or two per layer, got 1"):
        op(x, [w[0], w[0]], 1e-5, [w] * 4, [0] * 4, [0] * 4, [1], [2], caches=[cache, cache],
           **{**args, "head_norms": [w[0]]})


def test_kept_arguments_follow_changes_to_the_model(monkeypatch):
    """The op's arguments are kept between steps: quantizing, fusing or a new KV cache after a step must be seen by
    the next one (each equal to a model that had them from the start, stepped layer by layer)."""
    from llama.core.worker.kv_cache import KVCache

    def step(model):
        model(torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(0)), 0)
        return model(torch.tensor([[5]]), 4)

    changes = [lambda m: m.fuse(), lambda m: quantize_int4(m, 32), lambda m: KVCache(m, 2, 16)]
    model = model_in("none", False)
    step(model)
    assert fused_decode._kept  # the first step's arguments, kept
    for i, change in enumerate(changes):
        change(model)
        assert not fused_decode._kept
        got = step(model)
        assert model.max_batch_size == (2 if i == 2 else 4)
        last = model.layers[-1].attention  # the step wrote the cache in use (row 0's position 4, through its table)
        assert last.cache_k[last.block_table[0, 0], :, 4].abs().sum() > 0
        want_model = model_in("none", False)
        for c in changes[: i + 1]:
            c(want_model)
        with monkeypatch.context() as patch:
            patch.setattr(fused_decode, "run", lambda *a, **k: None)
            assert torch.equal(got, step(want_model)), i


def test_importing_the_package_installs_no_global_hooks():
    """The kept arguments are forgotten explicitly (fused_decode.forget), not by process-wide module hooks."""
    from torch.nn.modules import module as nn_module

    import llama  # noqa: F401

    for name in ("_global_parameter_registration_hooks", "_global_buffer_registration_hooks",
                 "_global_module_registration_hooks"):
        assert not getattr(nn_module, name), name
