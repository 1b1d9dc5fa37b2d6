"""The K-quants' products of 2 to 8 activation rows (a speculative verify step's k + 1 tokens) unpack each weight
super-block once for all rows (llama/kernels/csrc/gguf_krows.h; Q4_K_X8: gguf_x8_dot.h's rows loop, now in both
copies), and gguf_gemm.cpp takes 9 rows and more (Q2_K 8): every row count 1..9, every K-quant format and both
copies of the inner loops (AVX2 and AVX-512 VNNI) give every row the one-row product bit for bit, and that product
is gguf's numpy dequantization times our int8 activations."""

import hardware
import pytest
import torch
from gguf_blocks_data import dequantized, quantized_activations, random_blocks

from llama.kernels import cpu
pytestmark = hardware.KERNELS

KQUANTS = ["Q6_K", "Q5_K", "Q4_K", "Q4_K_X8", "Q3_K", "Q2_K", "IQ4_XS"]
VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu.cpu_flags()
COPIES = ["1", "0"] if VNNI else ["0"]
K, N = 2048, 19  # 8 super-blocks (the fp32 sums' order over blocks shows); Q4_K_X8: 2 groups of 8 and 3 rows past


def weight(kind, seed):
    """(weight as the kernels run it, qtype, gguf's fp32 dequantization of it)"""
    import gguf

    file_kind = "Q4_K" if kind == "Q4_K_X8" else kind
    blocks = random_blocks(file_kind, N, K, seed=seed)
    ref = dequantized(blocks, file_kind)
    if kind == "Q4_K_X8":
        return cpu.gguf_repack(torch.from_numpy(blocks)), cpu.Q4_K_X8, ref
    return torch.from_numpy(blocks), int(gguf.GGMLQuantizationType[kind]), ref


def activations(m, seed):
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(seed))
    x[m // 2] *= 300.0  # rows of very different ranges
    x[1, 256:512] = 0.0  # an all-zero block
    x[-1, :256] *= 1e-3  # and a very small one
    return x


@pytest.mark.parametrize("kind", KQUANTS)
def test_every_row_count_gives_each_row_its_one_row_product_bitwise(kind, monkeypatch):
    w, qtype, _ = weight(kind, seed=7)
    x = activations(9, seed=8)
    for avx512 in COPIES:
        monkeypatch.setenv("LLAMA_CPU_AVX512", avx512)  # read by the kernels on every call
        ones = [cpu.gguf_linear(x[i : i + 1], w, qtype)[0] for i in range(9)]
        for m in range(1, 10):
            for start in sorted({0, 9 - m, (9 - m) // 2}):  # each row in several positions of several batches
                many = cpu.gguf_linear(x[start : start + m], w, qtype)
                for i in range(m):
                    got, want = many[i], ones[start + i]
                    assert torch.equal(got, want), (kind, avx512, m, start + i, (got - want).abs().max().item())


@pytest.mark.parametrize("kind", KQUANTS)
def test_many_row_products_are_gguf_dequantized_weights_times_our_int8_activations(kind, monkeypatch):
    w, qtype, ref_w = weight(kind, seed=9)
    w64 = ref_w.double()
    for m in range(2, 10):
        x = activations(m, seed=10 + m)
        xq = quantized_activations(x, 256)
        ref = xq @ w64.T
        bound = (xq.abs() @ w64.abs().T) * (K / 16 + 8) * 2.0**-24  # fp32 rounding of the scaled block sums
        for avx512 in COPIES:
            monkeypatch.setenv("LLAMA_CPU_AVX512", avx512)
            err = (cpu.gguf_linear(x, w, qtype).double() - ref).abs()
            assert (err <= bound).all(), (kind, avx512, m, (err / bound).max().item())


@pytest.mark.skipif(not VNNI, reason="hardware: one copy of the inner loops on this CPU")
@pytest.mark.parametrize("kind", KQUANTS)
def test_both_copies_give_the_same_rows(kind, monkeypatch):
    w, qtype, _ = weight(kind, seed=11)
    x = activations(8, seed=12)
    out = {}
    for avx512 in COPIES:
        monkeypatch.setenv("LLAMA_CPU_AVX512", avx512)
        out[avx512] = [cpu.gguf_linear(x[:m], w, qtype) for m in (2, 3, 5, 8)]
    assert all(torch.equal(a, b) for a, b in zip(out["0"], out["1"]))


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q6_K"])
def test_a_k_quant_files_verify_rows_are_its_one_token_steps_bitwise(ftype, monkeypatch, tmp_path):
    """llama.cpp's quantizations of SmolLM2-135M (their ffn_down is Q6_K, Q5_K or Q4_K -> Q4_K_X8; its 576 inputs
    are not whole super-blocks, so the rest is 32-value types) through the whole step, both copies: each row of a
    1..8-row Verify pass gives exactly the logits of the one-token Decode step at its position."""
    import ctypes

    from conftest import SHARED, need
    from helpers import assert_verify_rows_are_decode_steps

    from llama import Llama

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    src = need(SHARED / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
    path = tmp_path / f"SmolLM2-135M-Instruct.{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize, params.nthread = True, 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(path).encode(), ctypes.byref(params)) == 0
    g = Llama.build(str(path), None, max_seq_len=64, max_batch_size=1, compile=False, prefix_cache="off")
    for avx512 in COPIES:
        monkeypatch.setenv("LLAMA_CPU_AVX512", avx512)
        assert_verify_rows_are_decode_steps(g, (ftype, avx512))
