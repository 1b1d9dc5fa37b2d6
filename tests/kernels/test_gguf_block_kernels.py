"""Our kernels on GGUF's block formats (llama/kernels/csrc/gguf_blocks.cpp) against gguf's numpy dequantization:
rows dequantize bit-exactly, products equal (gguf's dequantized weights) x (our int8 activations) to fp32 rounding,
and a row's result does not depend on the batch it is in."""

import hardware
import pytest
import torch
from gguf_blocks_data import (
    act_block,
    dequantized,
    quantized_activations,
    random_blocks,
    reference_product,
)

from llama.kernels import cpu
pytestmark = hardware.KERNELS

NATIVE = ["Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q4_0", "IQ4_XS", "IQ4_NL", "Q5_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K"]


def qtype(kind):
    import gguf

    return int(gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", NATIVE)
def test_rows_dequantize_bit_exactly_as_gguf(kind):
    blocks = random_blocks(kind, 7, 512, seed=1)
    w = torch.from_numpy(blocks)
    ids = torch.tensor([[6, 0], [3, 3]])
    ours = cpu.gguf_rows(w, ids, qtype(kind))
    ref = dequantized(blocks, kind)
    assert ours.shape == (2, 2, 512) and torch.equal(ours, ref[ids]), kind


@pytest.mark.parametrize("kind", NATIVE)
def test_products_equal_dequantized_weights_times_our_int8_activations(kind):
    K, N, M = 1024, 24, 5
    blocks = random_blocks(kind, N, K, seed=2)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(3))
    x[1] *= 40.0  # rows of very different ranges
    x[2, :300] = 0.0  # all-zero blocks
    ours = cpu.gguf_linear(x, torch.from_numpy(blocks), qtype(kind))
    w = dequantized(blocks, kind).double()
    xq = quantized_activations(x, act_block(kind))
    ref = reference_product(x, blocks, kind)
    bound = (xq.abs() @ w.abs().T) * (K / 16 + 8) * 2.0**-24  # fp32 rounding of the scaled block sums
    assert ours.dtype == torch.float32
    err = (ours.double() - ref).abs()
    assert (err <= bound).all(), (kind, (err / bound).max().item())
    # not the unquantized product: the test sees the int8 activations (their error is far above the bound)
    assert ((x.double() @ w.T - ref).abs() > bound).any()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_a_rows_result_does_not_depend_on_its_batch(kind):
    K, N = 512, 40
    w = torch.from_numpy(random_blocks(kind, N, K, seed=4))
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(5))
    batch = cpu.gguf_linear(x, w, qtype(kind))
    for i in range(x.shape[0]):
        assert torch.equal(cpu.gguf_linear(x[i : i + 1], w, qtype(kind))[0], batch[i]), i
    assert torch.equal(cpu.gguf_linear(x.to(torch.bfloat16), w, qtype(kind)).float(),
                       cpu.gguf_linear(x.to(torch.bfloat16).float(), w, qtype(kind)).to(torch.bfloat16).float())


VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu.cpu_flags()


@pytest.mark.skipif(not VNNI, reason="hardware: this CPU lacks AVX-512 VNNI: only the AVX2 path runs here")
@pytest.mark.parametrize("kind", NATIVE)
def test_the_avx512_path_gives_the_avx2_paths_results_bitwise(kind, monkeypatch):
    """The AVX-512 VNNI copy (gguf_dot.h) sums the same integers in the same lanes and the same fp32 operations in
    the same order: any difference is a bug, not rounding."""
    K, N = 1280, 67
    w = torch.from_numpy(random_blocks(kind, N, K, seed=6))
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(7))
    x[1] *= 1e3
    fast = cpu.gguf_linear(x, w, qtype(kind))
    monkeypatch.setenv("LLAMA_CPU_AVX512", "0")  # read by the kernel on every call
    slow = cpu.gguf_linear(x, w, qtype(kind))
    assert torch.equal(fast, slow), (kind, (fast - slow).abs().max().item())


def test_bad_shapes_are_refused_naming_the_sizes():
    w = torch.from_numpy(random_blocks("Q4_K", 4, 512))
    with pytest.raises(RuntimeError, match="inputs"):
        cpu.gguf_linear(torch.randn(1, 256), w, qtype("Q4_K"))
    with pytest.raises(RuntimeError, match="not run natively"):
        cpu.gguf_linear(torch.randn(1, 512), w, qtype("IQ2_XXS"))
    with pytest.raises(RuntimeError, match="row 9 of 4"):
        cpu.gguf_rows(w, torch.tensor([9]), qtype("Q4_K"))
