"""Products of a few activation rows (a speculative verify step's k + 1 tokens: llama/kernels/csrc/gguf_rows.h for
the 32-value formats, gguf_krows.h and gguf_gemm.cpp for the K-quants, also test_gguf_krows.py) give every row the
one-row product's result bit for bit, for every row count 1..9, every native format and both copies of the inner
loops (AVX2 and AVX-512 VNNI): a verify row's logits are the one-token step's, which speculation's exactness needs."""

import hardware
import pytest
import torch
from gguf_blocks_data import random_blocks

from llama.kernels import cpu
pytestmark = hardware.KERNELS

NATIVE = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q4_K_X8", "Q5_K", "Q6_K", "IQ4_XS", "Q2_K",
          "Q3_K"]
SUPER_BLOCKS = {"Q4_K", "Q4_K_X8", "Q5_K", "Q6_K", "IQ4_XS", "Q2_K", "Q3_K"}  # 256 values a block
VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu.cpu_flags()
COPIES = ["1", "0"] if VNNI else ["0"]


def weight(kind, n, k, seed):
    """(weight, qtype) of n outputs and k inputs; Q4_K_X8: Q4_K repacked 8 rows at a time, as the loader runs it."""
    import gguf

    if kind == "Q4_K_X8":
        return cpu.gguf_repack(torch.from_numpy(random_blocks("Q4_K", n, k, seed=seed))), cpu.Q4_K_X8
    return torch.from_numpy(random_blocks(kind, n, k, seed=seed)), int(gguf.GGMLQuantizationType[kind])


def activations(m, k, seed):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[m // 2] *= 300.0  # rows of very different ranges
    if m > 2:
        x[1, :256] = 0.0  # all-zero blocks
    return x


@pytest.mark.parametrize("kind", NATIVE)
def test_each_row_count_gives_every_row_the_one_row_product_bitwise(kind, monkeypatch):
    # 25 blocks of 32 (an odd count: Q4_0's and IQ4_NL's block pairs and a last block alone) or 3 of 256; 21
    # outputs: Q4_K_X8's groups of 8 and 5 rows past them
    K = 768 if kind in SUPER_BLOCKS else 800
    w, qtype = weight(kind, 21, K, seed=21)
    x = activations(9, K, seed=22)
    for avx512 in COPIES:
        monkeypatch.setenv("LLAMA_CPU_AVX512", avx512)  # read by the kernels on every call
        ones = [cpu.gguf_linear(x[i : i + 1], w, qtype)[0] for i in range(9)]
        for m in range(1, 10):
            for start in {0, 9 - m}:  # rows 0 .. m and the last m: each row in several positions and batches
                many = cpu.gguf_linear(x[start : start + m], w, qtype)
                for i in range(m):
                    got, want = many[i], ones[start + i]
                    assert torch.equal(got, want), (kind, avx512, m, start + i, (got - want).abs().max().item())


@pytest.mark.skipif(not VNNI, reason="hardware: one copy of the inner loops on this CPU")
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_1", "IQ4_NL"])
def test_both_copies_agree_on_few_rows(kind, monkeypatch):
    K = 800
    w, qtype = weight(kind, 37, K, seed=5)
    x = activations(5, K, seed=6)
    out = {}
    for avx512 in COPIES:
        monkeypatch.setenv("LLAMA_CPU_AVX512", avx512)
        out[avx512] = cpu.gguf_linear(x, w, qtype)
    assert torch.equal(out["0"], out["1"])


def test_a_real_models_verify_rows_are_its_one_token_steps_bitwise():
    """SmolLM2-135M's Q4_1 file (Q8_0 output product) through the whole step: each row of a 1..8-row Verify pass
    gives exactly the logits of the one-token Decode step at its position, what speculation's exactness needs."""
    from conftest import SHARED, need
    from helpers import assert_verify_rows_are_decode_steps

    from llama import Llama

    path = need(SHARED / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
    g = Llama.build(str(path), None, max_seq_len=64, max_batch_size=1, compile=False, prefix_cache="off")
    assert_verify_rows_are_decode_steps(g)
