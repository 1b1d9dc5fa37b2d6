"""The int8 product's row tiles (q8_tile and q8_tile_vnni in llama/kernels/csrc/cpu_kernels.cpp), on each copy
(AVX2, and AVX-512 VNNI where the CPU has it): a row's result is bitwise the same alone and within batches of 2 to 9
rows (tiles of 4: whole, partial and mixed), which speculative decoding's exactness needs (a verify step's rows equal
the decode steps'), and it is the int8 weight times its row scale times the block-quantized activations, summed in
float64, within fp32 rounding."""

import hardware
import pytest
import torch
from helpers import assert_rows_batch_invariant, block_quantized


pytestmark = hardware.KERNELS

# (outputs, inputs): 16-block groups plus a last 8 (768 = 24 blocks; 11008's 344 blocks at 7B), only 8 blocks, only
# 16-block groups (4096's 128 blocks: spans of 128 and a second one), more outputs than a span of 8, and inputs not
# a multiple of 8 blocks (the AVX2 tile on both copies)
SHAPES = [(24, 768), (16, 256), (12, 4608), (20, 1024), (8, 11008), (9, 320)]


def weight(n: int, k: int):
    """Random int8 codes over the whole range (-128 included: w + 128 is 0) and a scale per row."""
    torch.manual_seed(n * k)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    codes[0, :64] = -128
    codes[1, :64] = 127
    return codes, (torch.rand(n) + 0.1) * torch.logspace(-3, -1, n)


def rows(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k) * torch.logspace(-1, 1, k)  # blocks of different scales
    x[0, 32:64] = 0  # an all-zero block
    x[1, 64:96] = -x[1, 64:96].abs()  # a block of -127 .. 0 codes: the offset at its largest
    return x


@pytest.mark.parametrize("n, k", SHAPES)
def test_a_row_is_the_same_alone_and_in_any_batch(n, k, kernel_copy):
    w, s = weight(n, k)
    x = rows(9, k)
    product = lambda v: torch.ops.llama_cpu.int8_linear(v.contiguous(), w, s)
    assert_rows_batch_invariant(product, x)


@pytest.mark.parametrize("n, k", SHAPES)
def test_the_product_is_the_dequantized_one_within_fp32_rounding(n, k, kernel_copy):
    """Within 4 units of fp32's last place (2^-24) of the sum of the terms' magnitudes (each block's integer total
    is exact; only its fp32 scaling and summing round); an error in one block's total is far larger."""
    w, s = weight(n, k)
    x = rows(5, k)
    xq = block_quantized(x)
    dequantized = w.double() * s.double()[:, None]
    want = xq @ dequantized.T
    magnitude = xq.abs() @ dequantized.abs().T
    got = torch.ops.llama_cpu.int8_linear(x, w, s).double()
    assert ((got - want).abs() <= 4 * 2.0**-24 * magnitude).all()
