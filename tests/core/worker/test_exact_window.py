"""prefix_cache="exact" with a sliding window (Mistral v0.1) and an attention multiplier (Granite): our CPU kernel
applies both (llama/kernels/csrc/decode_ops.cpp), so a position's logits are bitwise the same cold, cached, chunked,
batched and as a decode step, for a window shorter than the prompt, in fp32 and bf16, with a bf16/fp32 or int8 KV
pool; and they are the model's: the SDPA path's (mask and scale) to rounding. Where "exact" does not hold (CUDA,
fp16, head_dim not a multiple of 8, no kernels) it is refused (llama/core/worker/exact.py)."""

from types import SimpleNamespace

import hardware
import pytest
import torch
from conftest import ON_CUDA, STORIES, need
from helpers import logprobs_in_any_company
from test_exact_invariance import PROMPT
from test_exact_quantized import assert_rows_invariant

from llama.kernels import cpu
pytestmark = [hardware.KERNELS,
              pytest.mark.skipif(ON_CUDA, reason="hardware: prefix_cache='exact' runs on the CPU only")]

WINDOW = 20  # PROMPT is 71 tokens: the window cuts from position 20 on
SHAPE = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 256, "norm_eps": 1e-5,
         "vocab_size": 512}
WINDOWED, SCALED = {"sliding_window": WINDOW}, {"attention_multiplier": 0.3}  # 0.3, not 64 ** -0.5 = 0.125
GRANITE = {**SCALED, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 4.0}  # all four


def build(tmp_path, extra, mode="exact", **kw):
    from llama import Llama
    from llama.hub.demo import write_random_checkpoint

    name = "m" + "".join(f"-{k}{v}" for k, v in sorted(extra.items()))
    ckpt = tmp_path / name
    if not ckpt.exists():  # the same seed: the same weights with and without the window or multiplier
        write_random_checkpoint(ckpt, {**SHAPE, **extra}, tokenizer_path=need(STORIES / "tokenizer.model"))
    return Llama.build(str(ckpt), str(ckpt / "tokenizer.model"), max_seq_len=256, max_batch_size=6,
                       prefix_cache=mode, compile=False, **kw)


def logits(llm, ids):
    with llm.cache.hold():
        return llm.runner.logits([ids])[0].float()


CONFIGS = [  # (family settings, dtype, kv_cache_dtype)
    (WINDOWED, "fp32", None), (WINDOWED, "bf16", "int8"), (WINDOWED, "bf16", None), (SCALED, "fp32", "int8"),
    (SCALED, "bf16", None), ({**WINDOWED, **SCALED}, "fp32", None), ({**WINDOWED, **SCALED}, "bf16", "int8"),
]


@pytest.mark.parametrize("extra,dtype,kv", CONFIGS,
                         ids=["-".join([*e, d, k or "float-kv"]) for e, d, k in CONFIGS])
def test_window_and_multiplier_give_every_pass_the_same_rows(tmp_path, extra, dtype, kv):
    """Whole, chunked (first chunk one token), cached (48 positions from another row's blocks, past the window),
    beside a longer companion, and the last token as a decode step at position 70."""
    assert_rows_invariant(build(tmp_path, extra, dtype=dtype, kv_cache_dtype=kv))


@pytest.mark.parametrize("extra", [WINDOWED, SCALED], ids=["window", "multiplier"])
def test_exact_attention_is_the_models(tmp_path, extra):
    """fp32: the exact mode's prefill is the SDPA path's (its mask's window, its scale) to rounding, and differs from
    the same weights without the window or multiplier, so the kernel applies them and they matter here."""
    exact, sdpa = build(tmp_path, extra), build(tmp_path, extra, mode="off")
    plain = build(tmp_path, {}, mode="off")
    got, want, without = logits(exact, PROMPT), logits(sdpa, PROMPT), logits(plain, PROMPT)
    assert (got - want).abs().max() < 1e-4
    late = slice(WINDOW, None) if extra is WINDOWED else slice(None)
    assert (without[late] - want[late]).abs().max() > 1e-2
    if extra is WINDOWED:  # before the window cuts, the window changes nothing
        assert (without[:WINDOW] - want[:WINDOW]).abs().max() < 1e-4


def test_decode_steps_past_the_window_are_the_models(tmp_path):
    """fp32 greedy decoding beyond the window (the one-token step then attends the newest WINDOW positions): the
    exact mode's tokens are the SDPA path's, logprobs to rounding."""
    prompt = "Once upon a time there was a little cat who liked to play in the park."
    opts = dict(temperature=0.0, max_gen_len=24, logprobs=True)
    extra = {**WINDOWED, **SCALED}
    got = build(tmp_path, extra).text_completion([prompt], **opts)[0]
    want = build(tmp_path, extra, mode="off").text_completion([prompt], **opts)[0]
    assert got["tokens"] == want["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) < 1e-4


@pytest.mark.parametrize("dtype,kv", [("bf16", "int8"), ("bf16", None)])
def test_logprobs_are_a_cold_caches_in_any_company_and_chunking(tmp_path, dtype, kv):
    prompts = ["Once upon a time there was a little cat who liked to play in the park with her friend the dog.",
               "Once upon a time there was a little cat who liked to sleep.", "The bird sang a song."]
    """Granite's four multipliers and a window, through Llama calls and the engine."""
    llm = build(tmp_path, {**WINDOWED, **GRANITE}, dtype=dtype, kv_cache_dtype=kv)
    opts = dict(temperature=0.0, max_gen_len=24, logprobs=True)
    alone, batch, cached, chunked = logprobs_in_any_company(llm, prompts, opts, longer=prompts[0] * 2)
    assert batch == alone and cached == alone and chunked == alone
    assert llm.cache.pool.stats["cached_tokens"] >= 16


def fake(device="cpu", dtype=torch.float32, head_dim=64):
    return SimpleNamespace(norm=SimpleNamespace(weight=torch.empty(1, device=device, dtype=dtype)),
                           params=SimpleNamespace(head_dim=head_dim))


@pytest.mark.parametrize("model,message", [
    (fake(device="meta"), r"prefix_cache='exact' runs on the CPU only, got a model on meta"),
    (fake(dtype=torch.float16), r"fp32 or bf16 activations, got torch.float16"),
    (fake(head_dim=12), r"head_dim a multiple of 8, got 12"),
])
def test_what_exact_does_not_cover_is_refused(model, message):
    """CUDA stands for any device but the CPU (no GPU here): nothing replaces SDPA's and cuBLAS's shape-dependent
    reductions there, so "exact" is refused rather than silently inexact."""
    from llama.config import CacheConfig, SchedulerConfig
    from llama.core.worker.kv_cache import build_cache

    with pytest.raises(ValueError, match=message):
        build_cache(model, SchedulerConfig(16, 1), CacheConfig("exact"))


def test_exact_without_our_kernels_is_refused(monkeypatch):
    from llama.config import CacheConfig, SchedulerConfig
    from llama.core.worker.kv_cache import build_cache

    monkeypatch.setattr(cpu, "available", lambda: False)
    with pytest.raises(ValueError, match=r"needs our CPU kernels"):
        build_cache(fake(), SchedulerConfig(16, 1), CacheConfig("exact"))
