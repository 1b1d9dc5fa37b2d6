"""The int4 product's row tiles (llama/kernels/csrc/int4_tiles.h), on each copy (AVX2, and AVX-512 VNNI where the
CPU has it): a row's result is bitwise the same alone and within batches of 2 to 9 rows (tiles of 4: whole, partial
and mixed), which speculative decoding's exactness needs (a verify step's rows equal the decode steps'), and it is
the dequantized weight times the block-quantized activations, summed in float64, within fp32 rounding."""

import hardware
import pytest
import torch
from helpers import assert_rows_batch_invariant, block_quantized

from llama.quantization.int4 import dequantize_codes

pytestmark = hardware.KERNELS

# (outputs, inputs, group): 16-block groups plus a last 8 (768 = 24 blocks; 11008's 344 blocks at 7B), only 8
# blocks, only 16-block groups, one scale for 8 blocks, and inputs not a multiple of 8 blocks (the group loop)
SHAPES = [(24, 768, 32), (16, 256, 64), (12, 1024, 128), (10, 768, 256), (8, 11008, 32), (9, 320, 64)]


def weight(n: int, k: int, g: int):
    """Random codes and (scale, zero) pairs in the storage layout (quantize_codes's search is slow at 11008)."""
    torch.manual_seed(n * k + g)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    groups = -(-k // g)
    scale = (torch.rand(n, groups) + 0.1) * torch.logspace(-3, -1, n)[:, None]
    zero = torch.randn(n, groups) * scale * 4
    return codes, torch.stack([scale, zero], dim=-1).bfloat16()


def rows(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k) * torch.logspace(-1, 1, k)  # blocks of different scales
    x[0, 32:64] = 0  # an all-zero block
    return x


@pytest.mark.parametrize("n, k, g", SHAPES)
def test_a_row_is_the_same_alone_and_in_any_batch(n, k, g, kernel_copy):
    codes, scales = weight(n, k, g)
    x = rows(9, k)
    product = lambda v: torch.ops.llama_cpu.int4_linear(v.contiguous(), codes, scales, g)
    assert_rows_batch_invariant(product, x)


@pytest.mark.parametrize("n, k, g", SHAPES)
def test_the_product_is_the_dequantized_one_within_fp32_rounding(n, k, g, kernel_copy):
    """Within 4 units of fp32's last place (2^-24) of the sum of the terms' magnitudes: measured at most 0.25 here; an
    error the size of bf16's rounding (2^-8) would be 2^16 units."""
    codes, scales = weight(n, k, g)
    x = rows(5, k)
    q = ((codes[:, :, None] >> torch.tensor([0, 4])) & 15).reshape(n, k).double()  # even k in the low nibbles
    groups = torch.arange(k) // g
    s, z = scales.double()[:, groups, 0], scales.double()[:, groups, 1]
    assert torch.equal((q - 8) * s + z, dequantize_codes(codes, scales, g).double())
    xq = block_quantized(x)
    want = xq @ ((q - 8) * s + z).T
    magnitude = xq.abs() @ (q * s.abs() + (z - 8 * s).abs()).T  # the kernel's w = code * s + (z - 8 s)
    got = torch.ops.llama_cpu.int4_linear(x, codes, scales, g).double()
    assert ((got - want).abs() <= 4 * 2.0**-24 * magnitude).all()
