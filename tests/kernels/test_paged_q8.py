"""kv_cache_dtype="int8" stores each position's keys and values rotated, then as llama.cpp's q8_0
(llama/kernels/paged.py): codes and fp16 scales bitwise gguf's numpy Q8_0, groups of 32 within a head, a position's
bytes its own; attention in the stored basis is attention over the decoded keys and values; and on SmolLM2's real
keys and values the rotation makes less error than plain q8_0."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import SHARED, need

from llama.kernels import paged

SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def values(head_dim: int, dtype=torch.bfloat16) -> torch.Tensor:
    """(positions, heads, head_dim) of spread magnitudes: a large group beside small ones, a zero group, ties."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, head_dim, generator=g) * torch.logspace(-3, 2, 7)[:, None, None]
    x[:, 0, -head_dim // 2 :] *= 40  # one half of a head far larger than the other
    x[2, 1] = 0  # a zero head
    x[3, 2, :4] = torch.tensor([0.5, -0.5, 1.5, 127.0]) / 127 * 3  # exact ties at code .5
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scales_are_ggufs_q8_0_and_codes_the_nearest_for_them(dtype):
    """gguf's numpy Q8_0 (llama.cpp's): the same fp16 scales; codes rounded against the stored scale, so every value
    is read back within half a step (gguf's codes, from the fp32 scale, may be one off and farther)."""
    gguf = pytest.importorskip("gguf")
    x = values(64, dtype)
    codes, scales = paged.quantize(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (7, 3, 2)
    raw = gguf.quants.quantize(x.float().numpy().reshape(-1, 64), gguf.GGMLQuantizationType.Q8_0)
    blocks = raw.reshape(-1, 34)  # per block of 32: fp16 d, 32 int8 codes
    want_d = torch.from_numpy(blocks[:, :2].copy().view(np.float16).reshape(7, 3, 2))
    want_codes = torch.from_numpy(blocks[:, 2:].copy().view(np.int8).reshape(7, 3, 64))
    assert torch.equal(scales, want_d)
    assert (codes.int() - want_codes.int()).abs().max() <= 1
    back = paged.dequantize(codes, scales, torch.float32)
    step = scales.float().repeat_interleave(32, dim=-1)
    assert ((back - x.float()).abs() <= step / 2 * (1 + 2**-20)).all()
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(7, 3, 64))
    assert (back - x.float()).norm() <= (theirs - x.float()).norm()


def test_a_positions_bytes_are_its_own_and_groups_stay_in_a_head():
    x = values(64)
    codes, scales = paged.quantize(x)
    for p in range(x.shape[0]):
        c, s = paged.quantize(x[p : p + 1])
        assert torch.equal(c[0], codes[p]) and torch.equal(s[0], scales[p])
    # head 0's large half (20-70x) does not coarsen its small half: about half a step of the small half's own scale
    # (codes use d in fp32, the stored d is fp16: q8_0's), where one scale per head would give 10-35 of them
    err = (paged.dequantize(codes, scales, torch.float32) - x.float()).abs()
    step = x[:, 0, :32].float().abs().amax(-1) / 127
    assert (err[:, 0, :32].amax(-1) <= 0.55 * step).all()
    c8, s8 = paged.quantize(values(8))  # head_dim under 32 (stories260K's 8): one scale per head
    assert s8.shape == (7, 3, 1) and c8.shape == (7, 3, 8)


def test_rotation_is_orthonormal_fixed_and_per_position():
    x = values(64, torch.float32)
    r = paged.rotate(x)
    assert torch.allclose(paged.unrotate(r), x, rtol=0, atol=1e-5 * float(x.abs().max()))
    assert torch.allclose(r.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert not torch.allclose(r, x) and not torch.allclose(r, paged.hadamard(x))  # the signs are applied
    for p in range(x.shape[0]):  # a position's rotation, codes and scales whatever else is in the call
        assert torch.equal(paged.rotate(x[p : p + 1])[0], r[p])
        c, s = paged.encode(x[p : p + 1])
        assert torch.equal(c[0], paged.encode(x)[0][p]) and torch.equal(s[0], paged.encode(x)[1][p])
    assert torch.equal(paged._signs(64, "cpu"), paged._signs(64, torch.device("cpu")))
    assert [paged.rotates(d) for d in (8, 64, 128, 48, 96, 1)] == [True, True, True, False, False, False]
    odd = values(48)  # not a power of two: plain q8_0, as before (and its own scheme name)
    assert all(torch.equal(a, b) for a, b in zip(paged.encode(odd), paged.quantize(odd)))
    assert paged.scheme(48) == "q8_0/48" and paged.scheme(64) != paged.scheme(48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_in_the_stored_basis_is_attention_over_the_decoded_pool(dtype):
    """The model's path (paged.attending, SDPA, from_stored) against SDPA over what read() gives anyone else, the
    keys and values decoded to the model's basis; GQA (4 query heads on 2 KV heads), 2 rows of a block table."""
    g = torch.Generator().manual_seed(3)
    B, T, H, Hkv, D, bs = 2, 20, 4, 2, 64, 16
    cache_k = torch.zeros(6, Hkv, bs, D, dtype=torch.int8)
    cache_v = torch.zeros_like(cache_k)
    scales = tuple(torch.zeros(6, Hkv, bs, D // 32, dtype=torch.float16) for _ in "kv")  # keys', values'
    table = torch.tensor([[3, 1], [5, 2]])
    q, k, v = (torch.randn(B, T, n, D, generator=g).to(dtype) for n in (H, Hkv, Hkv))
    k[..., 5] *= 30  # an outlier channel
    paged.store(cache_k, cache_v, table, k, v, torch.arange(T)[None], scales)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    keys, values = paged.read(cache_k, cache_v, table, T, dtype, scales=scales)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
    sk, sv, sq = paged.attending(q, cache_k, cache_v, table, T, scales)
    got = paged.from_stored(F.scaled_dot_product_attention(sq.transpose(1, 2), sk, sv, attn_mask=mask,
                                                           enable_gqa=True).transpose(1, 2), cache_k)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.transpose(1, 2).float(), want.float(), atol=tol, rtol=tol)
    decoded = paged.decode(*paged.encode(k), torch.float32)  # read() is the decoded pool, in the model's basis
    assert torch.allclose(keys.float(), decoded.to(dtype).float().transpose(1, 2), rtol=0, atol=0)
    assert not torch.allclose(sk.float(), keys.float(), atol=1e-2)  # the pool holds the rotated heads


def smollm2_kv(llm, tokens):
    """SmolLM2's keys and values (every layer's, fp32) of one pass over tokens, as written to its cache."""
    got, write = [], paged.write
    paged.write = lambda cache, scales, blocks, offsets, x: got.append(x.float().clone()) or write(
        cache, scales, blocks, offsets, x)
    try:
        with llm.cache.hold():
            llm.runner.logits([tokens])
    finally:
        paged.write = write
    return torch.stack(got[0::2]), torch.stack(got[1::2])


def test_rotation_makes_less_error_on_smollm2s_keys_and_values(monkeypatch):
    """Real post-RoPE keys carry outlier channels that set a q8_0 group's step: rotated, the pool's keys come back
    with well under 0.75x plain q8_0's error (measured 0.63x), values with less (0.91x); and through the model the
    int8 pool's output distribution moves at most half as far (KL divergence from the fp32 cache's) as without.
    Weights dequantized to fp32 (LLAMA_GGUF_BLOCKS=0): the GGUF block products round activations to codes, a
    noise floor above int8's (docs/performance.md)."""
    from llama import Llama
    from llama.hub.demo import CORPUS

    path = str(need(SMOLLM2))
    monkeypatch.setenv("LLAMA_GGUF_BLOCKS", "0")
    ref = Llama.build(path, None, max_seq_len=160, max_batch_size=1, dtype="fp32", compile=False, prefix_cache="off")
    tokens = [ref.tokenizer.bos_id] + ref.tokenizer.encode(CORPUS.read_text(), bos=False, eos=False)[:150]
    keys, vals = smollm2_kv(ref, tokens)
    rel = lambda y, x: float((y - x).norm() / x.norm())  # noqa: E731
    for x, most in ((keys, 0.75), (vals, 0.95)):
        rotated = rel(paged.decode(*paged.encode(x), torch.float32), x)
        plain = rel(paged.dequantize(*paged.quantize(x), torch.float32), x)
        assert rotated < most * plain, (rotated, plain)
    with ref.cache.hold():
        want = ref.runner.logits([tokens])[0].log_softmax(-1)
    q8 = Llama.build(path, None, max_seq_len=160, max_batch_size=1, dtype="fp32", compile=False, prefix_cache="off",
                     kv_cache_dtype="int8")
    kl = {}
    for rotate in (True, False):
        monkeypatch.setattr(paged, "ROTATE", rotate)
        with q8.cache.hold():
            got = q8.runner.logits([tokens])[0].log_softmax(-1)
        kl[rotate] = float((want.exp() * (want - got)).sum(-1).mean())
    assert 0 < kl[True] < 0.5 * kl[False], kl


def test_the_scheme_is_part_of_a_prefix_blocks_key(monkeypatch):
    """Blocks written rotated are never read as plain q8_0 (or the reverse): the pool's salt names the scheme."""
    from test_model import random_model

    from llama.core.worker.kv_cache import pool_salt

    model = random_model()
    rotated = pool_salt(model, torch.int8, 16, (0, 0))
    monkeypatch.setattr(paged, "ROTATE", False)
    assert pool_salt(model, torch.int8, 16, (0, 0)) != rotated
    assert pool_salt(model, torch.float32, 16, (0, 0)) == pool_salt(model, torch.float32, 16, (0, 0))


def test_the_exact_modes_kernel_and_sdpa_read_the_rotated_pool_alike():
    """stories260K (head_dim 8, rotated) in fp32: the exact mode's kernel over the dequantized blocks
    (llama/kernels/exact_attention.py) and the SDPA path each rotate queries in and the output back, so both score
    a text as the fp32 cache does, to int8's error, and as each other."""
    from conftest import STORIES

    from llama import Llama

    d = str(need(STORIES))
    kw = dict(max_seq_len=128, max_batch_size=2, dtype="fp32", compile=False)
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    ref, sdpa, kernel = (Llama.build(d, d + "/tokenizer.model", prefix_cache=mode, kv_cache_dtype=kv, **kw).score(
        [text])[0]["logprobs"] for mode, kv in (("off", None), ("on", "int8"), ("exact", "int8")))
    diff = lambda a, b: max(abs(x - y) for x, y in zip(a, b))  # noqa: E731
    assert 0 < diff(ref, sdpa) < 0.05 and 0 < diff(ref, kernel) < 0.05 and diff(sdpa, kernel) < 0.01
