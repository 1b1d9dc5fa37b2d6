"""kv_cache_dtype="int8" stores each position's keys and values as llama.cpp's q8_0 (llama/kernels/paged.py): codes
and fp16 scales bitwise gguf's numpy Q8_0, groups of 32 within a head, a position's bytes its own."""

import numpy as np
import pytest
import torch

from llama.kernels import paged


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
