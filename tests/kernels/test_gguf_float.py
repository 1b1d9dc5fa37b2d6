"""gguf_linear_float (llama/kernels/csrc/gguf_float.cpp): GGUF block weights times fp32 activations
(LLAMA_GGUF_ACTIVATIONS=float; the default is gguf_x16.cpp's int16 activations, tests/kernels/test_gguf_x16.py). Checked against gguf's own numpy dequantization times the activations in
float64, for every block format our kernels run, and for batch invariance: a row's result is bitwise the same
alone, in any batch, and in the fused decode op."""

import hardware
import pytest
import torch

from llama.kernels import cpu
from tests.gguf_blocks_data import dequantized, random_blocks

pytestmark = hardware.KERNELS

KINDS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS"]


def _qtype(kind: str) -> int:
    import gguf

    return int(gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_equals_the_dequantized_product(kind):
    """Within fp32 rounding of the float64 product of gguf's dequantized weights (no activation quantization:
    int8 activation blocks would miss by ~1e-2 relative)."""
    N, K = 37, 512  # N not a multiple of the 4-row tile
    blocks = random_blocks(kind, N, K, seed=3)
    w = torch.from_numpy(blocks)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    got = torch.ops.llama_cpu.gguf_linear_float(x, w, _qtype(kind))
    want = (x.double() @ dequantized(blocks, kind).double().T)
    scale = (x.double().abs() @ dequantized(blocks, kind).double().abs().T)
    assert torch.all((got.double() - want).abs() <= 4e-6 * scale + 1e-30), kind
    int8 = cpu.gguf_linear(x, w, _qtype(kind))  # the other arithmetic really is further away
    assert (int8.double() - want).abs().max() > 10 * (got.double() - want).abs().max()


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K", "Q3_K"])
def test_rows_are_batch_invariant(kind):
    """Each row's result is the same bits alone, in batches of 2..9 and 64 rows, and under one or two threads."""
    N, K = 21, 768
    w = torch.from_numpy(random_blocks(kind, N, K, seed=5))
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([cpu.gguf_linear_float(x[i : i + 1], w, _qtype(kind)) for i in range(64)])
    for rows in (2, 3, 8, 9, 64):
        assert torch.equal(torch.ops.llama_cpu.gguf_linear_float(x[:rows], w, _qtype(kind)), alone[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(torch.ops.llama_cpu.gguf_linear_float(x, w, _qtype(kind)), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KINDS)
def test_unpack_gives_the_dequantized_weights(kind):
    """gguf_unpack (a prompt's products multiply its slices) gives gguf's dequantized values to fp32 rounding."""
    blocks = random_blocks(kind, 19, 512, seed=4)
    want = dequantized(blocks, kind)
    got = torch.ops.llama_cpu.gguf_unpack(torch.from_numpy(blocks), _qtype(kind))
    assert torch.allclose(got, want, rtol=2e-7, atol=1e-9), (got - want).abs().max()


def test_a_prompt_s_rows_go_through_the_gemm_and_decode_rows_never_do():
    """A prompt's pass of more than GGUF_FLOAT_MAX_ROWS rows runs as a GEMM on unpacked slices, within fp32
    rounding of the row kernel; a decode step of as many rows (B, 1, dim), and a prompt under row-invariant
    arithmetic, stay in the row kernel, bitwise."""
    from llama.kernels import invariant

    w = torch.from_numpy(random_blocks("Q4_1", 300, 1024, seed=8))
    x = torch.randn(1, cpu.GGUF_FLOAT_MAX_ROWS + 7, 1024)
    rows = torch.ops.llama_cpu.gguf_linear_float(x[0], w, _qtype("Q4_1"))
    gemm = cpu.gguf_linear_float(x, w, _qtype("Q4_1"))[0]
    assert torch.allclose(gemm, rows, rtol=1e-5, atol=1e-5) and not torch.equal(gemm, rows)
    assert torch.equal(cpu.gguf_linear_float(x.transpose(0, 1), w, _qtype("Q4_1"))[:, 0], rows)
    with invariant.rows():
        assert torch.equal(cpu.gguf_linear_float(x, w, _qtype("Q4_1"))[0], rows)


def test_bad_inputs_are_refused():
    w = torch.from_numpy(random_blocks("Q4_0", 4, 64))
    with pytest.raises(RuntimeError, match="inputs"):
        cpu.gguf_linear_float(torch.randn(1, 96), w, _qtype("Q4_0"))
    with pytest.raises(RuntimeError, match="not run natively"):
        cpu.gguf_linear_float(torch.randn(1, 64), w, 99)
    with pytest.raises(RuntimeError, match="file's layout"):
        cpu.gguf_linear_float(torch.randn(1, 256), torch.from_numpy(random_blocks("Q4_K", 8, 256)),
                                      cpu.Q4_K_X8)
