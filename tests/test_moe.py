"""Mixture-of-experts FFNs (llama/moe.py): route() and combine() against their definitions, an MoE layer's grouped
products against a dense loop over every expert, only routed experts read, a token's output the same alone and
batched, and the memory check counting every expert (llama/loading/memory.py). Tiny random models, all eager."""

import hardware
import pytest
import torch

from llama.distributed.parallel import init_distributed
from llama.kernels import invariant
from llama.layers import linear_layers
from llama.loading.memory import estimate, ffn_bytes
from llama.model import ModelArgs, Transformer
from llama.model_args import MoEArgs
from llama.moe import MoEFeedForward, combine, route
from llama.quantization.schemes import get, quantize

ARGS = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16, hidden_dim=96)
MOE = dict(n_experts=6, top_k=2, hidden_dim=32, dense_layers=[0])


def moe_model(seed=0, qk_norm=False, **moe):
    init_distributed(1, torch.device("cpu"))
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**ARGS, moe={**MOE, **moe}, qk_norm=qk_norm))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.05) + (1.0 if "norm" in name else 0.0))
    return model.requires_grad_(False).eval()


@pytest.fixture(scope="module")
def ffn():
    return moe_model().layers[1].feed_forward


def test_route_is_a_softmax_top_k_renormalised_where_the_model_does():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, -1.0, 5.0, 4.0]])
    probs = torch.softmax(logits, -1)
    w, e = route(logits, MoEArgs(n_experts=4, top_k=2, hidden_dim=8, renormalize=False))
    assert e.tolist() == [[1, 3], [2, 3]]  # a tie goes to the lower index
    assert torch.equal(w, probs.gather(1, e))
    w, e = route(logits.to(torch.bfloat16), MoEArgs(n_experts=4, top_k=2, hidden_dim=8))
    assert w.dtype == torch.float32 and torch.allclose(w.sum(-1), torch.ones(2))
    assert torch.allclose(w, probs.gather(1, e) / probs.gather(1, e).sum(-1, keepdim=True))


def test_combine_adds_each_rows_experts_in_rank_order_alone():
    g = torch.Generator().manual_seed(0)
    outputs, weights = torch.randn(5, 3, 16, generator=g), torch.rand(5, 3, generator=g)
    got = combine(outputs, weights)
    want = (outputs[:, 0] * weights[:, :1] + outputs[:, 1] * weights[:, 1:2]) + outputs[:, 2] * weights[:, 2:3]
    assert torch.equal(got, want)
    for i in range(5):
        assert torch.equal(combine(outputs[i : i + 1], weights[i : i + 1]), got[i : i + 1])


def dense_moe(ffn, x):
    """Every expert over every token, weighted by the router's top-k weights (0 elsewhere): the definition."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = route(ffn.gate(flat), ffn.moe)
    full = torch.zeros(flat.shape[0], ffn.moe.n_experts)
    full.scatter_(1, experts, weights)
    out = sum(full[:, e : e + 1] * ffn.experts[e](flat) for e in range(ffn.moe.n_experts))
    return out.view(x.shape)


def test_grouped_products_are_the_dense_loop_over_every_expert(ffn):
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ffn(x), dense_moe(ffn, x), rtol=1e-5, atol=1e-5)


def test_each_expert_runs_once_over_exactly_the_tokens_that_picked_it(ffn, monkeypatch):
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    _, experts = route(ffn.gate(x), ffn.moe)
    seen = {}
    for e, expert in enumerate(ffn.experts):
        monkeypatch.setattr(expert, "forward", lambda rows, e=e, f=expert.forward: seen.setdefault(e, []).append(
            rows.clone()) or f(rows))
    ffn(x)
    for e in range(ffn.moe.n_experts):
        tokens = [t for t in range(9) if e in experts[t].tolist()]  # in token order
        assert seen.get(e, []) == [] if not tokens else torch.equal(torch.cat(seen[e]), x[tokens]), e
        assert len(seen.get(e, [])) == (1 if tokens else 0), e
    assert 1 < len(seen) <= ffn.moe.n_experts


def test_a_tokens_output_is_the_same_alone_and_in_any_batch(ffn):
    """Row-invariant products (our kernels, invariant.rows) and a per-row combine: the exactness promise's base."""
    hardware.require_kernels()
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(3))
    with invariant.rows():
        whole = ffn(x)
        for i in (0, 5, 11):
            assert torch.equal(ffn(x[i : i + 1]), whole[i : i + 1]), i
        assert torch.equal(ffn(x[3:8]), whole[3:8])


def test_an_moe_layer_is_built_where_moe_args_say():
    model = moe_model(every=2, dense_layers=[])  # layers 1 only (0 and 2 fail (i + 1) % 2 == 0)
    kinds = [isinstance(layer.feed_forward, MoEFeedForward) for layer in model.layers]
    assert kinds == [False, True, False]
    assert [isinstance(layer.feed_forward, MoEFeedForward) for layer in moe_model().layers] == [False, True, True]


def resident(model, linear: bool) -> int:
    """Bytes of the linear layers' tensors (weights, scales), or of every other parameter."""
    layers = linear_layers(model)
    ids = {id(p) for m in layers for p in m.parameters(recurse=False)}
    return sum(p.numel() * p.element_size() for p in model.parameters() if (id(p) in ids) == linear)


@pytest.mark.parametrize("dtype,scheme,qk_norm", [(torch.float32, None, True), (torch.bfloat16, None, False),
                                                   (torch.bfloat16, "int8", False), (torch.float32, "int4", False)])
def test_the_memory_check_counts_every_experts_weights(dtype, scheme, qk_norm):
    """estimate()'s weights are the loaded model's linear tensors (every expert of every MoE layer, at the scheme's
    bits: its linear_bytes of each layer), its embeddings part the table, norms, qk-norms and the float routers."""
    model = moe_model(qk_norm=qk_norm).to(dtype)
    args = ModelArgs(**ARGS, moe=MOE, qk_norm=qk_norm, max_batch_size=2, max_seq_len=16)
    parts = estimate(args, dtype, scheme)
    if scheme is None:
        assert parts["weights"] == resident(model, linear=True)
    else:
        quantize(model, scheme)
        layers = linear_layers(model)
        assert parts["weights"] == sum(get(scheme).linear_bytes(m.out_features, m.in_features) for m in layers)
        assert resident(model, linear=True) <= parts["weights"]  # scales counted at 4 bytes, stored in 2 or 4
    assert parts["embeddings"] == resident(model, linear=False)
    dense = estimate(ModelArgs(**ARGS, max_batch_size=2, max_seq_len=16), dtype, scheme)
    expert, ffn = (ffn_bytes(h, 64, scheme, dtype, None) for h in (32, 96))
    assert parts["weights"] - dense["weights"] == 2 * (6 * expert - ffn)  # 6 experts of 32 for an FFN of 96, twice
