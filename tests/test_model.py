"""The model's fast paths give the reference's numbers: fused projections, the static decode step, bf16 caches and
the int8 fallback, on random tiny models and on stories260K's goldens. All eager, all quick."""

import pytest
import torch

from llama.core.worker.kv_cache import KVCache
from llama.distributed.parallel import init_distributed
from llama.model import ModelArgs, Transformer
from llama.quantization.int8 import linear

ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16)


def random_model(seed=0, dtype=torch.float32, max_batch=3, max_seq=24, **overrides):
    init_distributed(1, torch.device("cpu"))
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**{**ARGS, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.05) + (1.0 if "norm" in name else 0.0))
    model.to(dtype).eval()
    KVCache(model, max_batch, max_seq)
    return model


def test_fuse_keeps_logits_and_meta_names():
    model = random_model()
    meta = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 96, (2, 7))
    before = model(tokens, 0)
    step_before = model(tokens[:, :1], 7)
    model.fuse()
    assert model.layers[0].attention.wq is None and model.layers[0].attention.wqkv is not None
    assert model.layers[0].feed_forward.w13.weight.shape == (2 * ModelArgs(**ARGS).hidden_dim, 64)
    torch.testing.assert_close(model(tokens, 0), before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(tokens[:, :1], 7), step_before, rtol=1e-5, atol=1e-5)

    state = model.state_dict()  # split back into Meta's names
    assert sorted(state) == sorted(meta)
    for k in meta:
        assert torch.equal(state[k], meta[k]), k

    again = random_model(seed=1).fuse()  # a fused model still loads a Meta state dict
    again.load_state_dict(meta, strict=True)
    torch.testing.assert_close(again(tokens, 0), before, rtol=1e-5, atol=1e-5)


def test_fuse_is_idempotent():
    model = random_model().fuse()
    w = model.layers[1].attention.wqkv.weight
    model.fuse()
    assert model.layers[1].attention.wqkv.weight is w


@pytest.mark.parametrize("fused", [False, True])
def test_decode_step_matches_forward(fused):
    """The static decode step (what torch.compile traces) equals the eager step, with per-row positions and
    explicit cache rows."""
    model = random_model()
    if fused:
        model.fuse()
    prompts = torch.randint(0, 96, (3, 9))
    lengths = torch.tensor([9, 5, 7])
    model(prompts, 0)  # fill rows 0..2; each row continues at its own length
    nxt = torch.randint(0, 96, (3, 1))
    want = model(nxt, lengths)
    model(prompts, 0)
    got = model.decode_step(nxt, lengths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    rows = torch.tensor([2, 0])  # a sub-batch in chosen cache rows
    model(prompts, 0)
    want = model(nxt[:2], lengths[:2], rows=rows)
    model(prompts, 0)
    torch.testing.assert_close(model.decode_step(nxt[:2], lengths[:2], rows), want, rtol=1e-5, atol=1e-5)


def test_decode_step_greedy_goldens(stories, goldens):
    """The static step alone (no generation loop) reproduces the reference's greedy ids in fp32."""
    model = stories.model
    for g in goldens.values():
        prompt = g["prompt_tokens"]
        dev = model.norm.weight.device
        logits = model(torch.tensor([prompt], device=dev), 0)[:, -1]
        out = []
        for i in range(len(g["generated_tokens"])):
            tok = int(logits.argmax(-1))
            out.append(tok)
            logits = model.decode_step(torch.tensor([[tok]], device=dev), torch.tensor([len(prompt) + i], device=dev))[:, -1]
        assert out == g["generated_tokens"]


def test_bf16_model_keeps_a_bf16_cache_and_returns_fp32():
    model = random_model(dtype=torch.bfloat16).fuse()
    KVCache(model, 2, 16)
    assert model.layers[0].attention.cache_k.dtype == torch.bfloat16
    ref = random_model().fuse()
    tokens = torch.randint(0, 96, (2, 5))
    out = model(tokens, 0)
    assert out.dtype == torch.float32
    assert (out - ref(tokens, 0)).abs().max() < 0.1 * ref(tokens, 0).abs().max()


def test_cache_is_a_non_persistent_buffer():
    model = random_model()
    assert "layers.0.attention.cache_k" not in model.state_dict()
    assert any(name == "layers.0.attention.cache_k" for name, _ in model.named_buffers())


@pytest.mark.parametrize("k", [64, 40])  # 40: the int8 kernel needs in_features % 16 == 0, so it dequantizes
def test_int8_linear_matches_dequantized_product(k):
    x = torch.randn(2, 3, k, dtype=torch.bfloat16)
    q = torch.randint(-127, 128, (24, k), dtype=torch.int8)
    scales = (torch.rand(24) * 0.01 + 0.001).to(torch.bfloat16)
    got = linear(x, q, scales)
    want = x.float() @ (q.float() * scales.float()[:, None]).T
    assert got.shape == (2, 3, 24) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_llama_cpp_arithmetic_is_a_declared_flag_the_model_sets():
    """Transformer.use_ggml_arith sets every norm's, attention's and FFN's declared ggml_arith (ggml_arith.enable
    calls it); the batched products take each row's tokens from the model's own forward, which nothing replaces."""
    from llama.kernels import ggml_products
    from llama.model import Attention, FeedForward, RMSNorm

    model = random_model()
    parts = [m for m in model.modules() if isinstance(m, (RMSNorm, Attention, FeedForward))]
    assert len(parts) == 4 * len(model.layers) + 1 and not any(m.ggml_arith for m in parts)
    model.use_ggml_arith()
    assert all(m.ggml_arith for m in parts)
    ggml_products.install(model)
    assert "forward" not in vars(model)
    assert ggml_products.row_tokens(torch.tensor([[9], [6]])) == [10, 7] and ggml_products.row_tokens(None) is None
