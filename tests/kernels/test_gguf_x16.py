"""gguf_linear_x16 (llama/kernels/csrc/gguf_x16.cpp): GGUF block weights times activations quantized to int16 in
blocks of 32, the default arithmetic of a GGUF file on CPU. Checked against gguf's own numpy dequantization times
the same int16 activations in float64 for every format it decodes, against the unquantized product within the
activations' rounding, and for batch invariance: a row's result is bitwise the same alone, in any batch and under
any thread split. The formats it does not decode run gguf_linear_float's fp32 arithmetic, bit for bit."""

import hardware
import pytest
import torch

from llama.kernels import cpu
from tests.gguf_blocks_data import X16_TYPES, dequantized, random_blocks, x16_reference_product

pytestmark = hardware.KERNELS

KINDS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS"]


def _qtype(kind: str) -> int:
    import gguf

    return int(gguf.GGMLQuantizationType[kind])


def _x16(x, w, kind):
    return torch.ops.llama_cpu.gguf_linear_x16(x, w, _qtype(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_equals_the_int16_reference_or_the_fp32_path(kind):
    """Within fp32 rounding of the float64 product of gguf's dequantized weights and the int16 activations
    (x16_reference_product); the other formats are gguf_linear_float's result, bitwise."""
    N, K = 37, 512  # N not a multiple of a thread's 16 rows
    blocks = random_blocks(kind, N, K, seed=3)
    w = torch.from_numpy(blocks)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    got = _x16(x, w, kind)
    if kind not in X16_TYPES:
        assert torch.equal(got, torch.ops.llama_cpu.gguf_linear_float(x, w, _qtype(kind)))
        return
    want = x16_reference_product(x, blocks, kind)
    scale = x.double().abs() @ dequantized(blocks, kind).double().abs().T
    assert torch.all((got.double() - want).abs() <= 4e-6 * scale + 1e-30), kind


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"])
def test_an_odd_count_of_chunks_ends_on_the_even_chain(kind):
    """SmolLM2's 576 inputs are 18 chunks, 544 are 17: the last one goes alone."""
    blocks = random_blocks(kind, 11, 544, seed=12)
    x = torch.randn(3, 544, generator=torch.Generator().manual_seed(13))
    got = _x16(x, torch.from_numpy(blocks), kind).double()
    scale = x.double().abs() @ dequantized(blocks, kind).double().abs().T
    assert torch.all((got - x16_reference_product(x, blocks, kind)).abs() <= 4e-6 * scale)


@pytest.mark.parametrize("kind", X16_TYPES)
def test_the_error_is_the_activations_rounding_and_far_below_int8(kind):
    """Against the unquantized float64 product the error stays within each activation's rounding, half a step of
    1/32767 of its block's largest magnitude; int8 activation blocks miss by over 50 times as much."""
    N, K = 29, 1024
    blocks = random_blocks(kind, N, K, seed=7)
    w = torch.from_numpy(blocks)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.01, 10, K)  # uneven blocks
    got = _x16(x, w, kind).double()
    dense = dequantized(blocks, kind).double()
    want = x.double() @ dense.T
    step = x.reshape(4, -1, 32).abs().amax(-1).double().repeat_interleave(32, -1) / 32767
    bound = (step / 2) @ dense.abs().T + 4e-6 * (x.double().abs() @ dense.abs().T)
    err = (got - want).abs()
    assert torch.all(err <= bound), (err / bound).max()
    assert not torch.equal(got.float(), torch.ops.llama_cpu.gguf_linear_float(x, w, _qtype(kind)))  # it quantized
    int8 = cpu.gguf_linear(x, w, _qtype(kind)).double()
    assert (int8 - want).abs().max() > 50 * err.max()


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K", "Q8_0", "Q3_K"])
def test_rows_are_batch_invariant(kind):
    """Each row's result is the same bits alone, in batches of 2..9 and 64 rows, and under one or two threads."""
    N, K = 21, 768
    w = torch.from_numpy(random_blocks(kind, N, K, seed=5))
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([_x16(x[i : i + 1], w, kind) for i in range(64)])
    for rows in (2, 3, 8, 9, 64):
        assert torch.equal(_x16(x[:rows], w, kind), alone[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(_x16(x, w, kind), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K"])  # a block at a time, and the two super-block paths
def test_zero_rows_give_zero_and_a_non_finite_activation_spoils_only_its_row(kind):
    w = torch.from_numpy(random_blocks(kind, 16, 256, seed=9))
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    x[0] = 0.0
    x[1, 100], x[2, 3] = float("nan"), float("inf")
    y = _x16(x, w, kind)
    assert torch.equal(y[0], torch.zeros(16))
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.equal(y[3], _x16(x[3:], w, kind)[0]) and torch.isfinite(y[3]).all()


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
def test_activations_are_rounded_per_block_as_the_reference_says(kind):
    """With one large value in each block of 32, the block's small values round to a few steps of amax / 32767:
    the result is the reference's int16 arithmetic, far from the unquantized product."""
    K = 512
    blocks = random_blocks(kind, 24, K, seed=2)
    dense = dequantized(blocks, kind).double()
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(6)) * 0.01
    x[:, ::32] = 1000.0
    got = _x16(x, torch.from_numpy(blocks), kind).double()
    tol = 1e-6 * (x.double().abs() @ dense.abs().T)  # fp32 rounding of 16 blocks' exact int32 sums
    assert torch.all((got - x16_reference_product(x, blocks, kind)).abs() <= tol)
    assert ((got - x.double() @ dense.T).abs() > 10 * tol).any()


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q4_K"])
def test_a_prompt_s_rows_go_through_the_fp32_gemm_and_decode_rows_never_do(kind):
    """A prompt's pass of more than GGUF_FLOAT_MAX_ROWS rows is gguf_linear_float's GEMM, on the prompt's own
    activations: it differs from the int16 row kernel by the activations' rounding. A decode step of as many rows
    (B, 1, dim), and a prompt under row-invariant arithmetic, stay in the int16 row kernel, bitwise."""
    from llama.kernels import invariant

    w = torch.from_numpy(random_blocks(kind, 300, 1024, seed=8))
    x = torch.randn(1, cpu.GGUF_FLOAT_MAX_ROWS + 7, 1024) * 0.01
    x[..., ::32] = 100.0  # one large value a block: the int16 rounding of the others shows
    rows = _x16(x[0], w, kind)
    gemm = cpu.gguf_linear_x16(x, w, _qtype(kind))[0]
    assert torch.equal(gemm, cpu.gguf_linear_float(x, w, _qtype(kind))[0])
    tol = 1e-6 * (x[0].abs() @ torch.ops.llama_cpu.gguf_unpack(w, _qtype(kind)).abs().T)
    assert ((gemm - rows).abs() > 10 * tol).any()
    assert torch.equal(cpu.gguf_linear_x16(x.transpose(0, 1), w, _qtype(kind))[:, 0], rows)
    with invariant.rows():
        assert torch.equal(cpu.gguf_linear_x16(x, w, _qtype(kind))[0], rows)


def test_bad_inputs_are_refused():
    w = torch.from_numpy(random_blocks("Q4_0", 4, 64))
    with pytest.raises(RuntimeError, match="inputs"):
        cpu.gguf_linear_x16(torch.randn(1, 96), w, _qtype("Q4_0"))
    with pytest.raises(RuntimeError, match="not run natively"):
        cpu.gguf_linear_x16(torch.randn(1, 64), w, 99)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.llama_cpu.gguf_linear_x16(torch.randn(1, 64, dtype=torch.float64), w, _qtype("Q4_0"))
