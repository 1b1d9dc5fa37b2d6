"""The super-block formats' products against llama.cpp's q8_K arithmetic, written here from its spec in numpy: the
activations quantized as quantize_row_q8_K_ref (iscale = -127 / max, max the first element of the largest
magnitude with its sign, codes rounded half to even and capped at 127, d = 1 / iscale), the weights' integer parts
from gguf's own dequantization (each block's fp16 d and dmin set to 1 and 0, then 0 and 1: the sub-block scales
times the codes, and the mins), summed as integers per super-block and combined as d * dx * sum - dmin * dx * mins.
Each format to fp32 rounding, and bitwise in the order llama.cpp's x86 CPU code adds them (Q4_K, and Q2_K on
AVX-512: its repacked q4_K_8x8 / q2_K_8x8 products, one fp32 sum per output; Q3_K, Q5_K, Q6_K, IQ4_XS: its AVX2
dots, 8 fp32 lanes), on our AVX-512 and AVX2 copies alike."""

import hardware
import numpy as np
import pytest
import torch
from gguf_blocks_data import random_blocks

from llama.kernels import cpu
pytestmark = hardware.KERNELS
gguf = pytest.importorskip("gguf")

# bytes per block, and where its fp16 d and dmin sit (dmin None: no mins)
LAYOUT = {"Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, None), "Q2_K": (84, 80, 82),
          "Q3_K": (110, 108, None), "IQ4_XS": (136, 0, None)}
F32 = np.float32


def q8_k(x: np.ndarray):
    """(codes (M, nb, 256) int64, d (M, nb) fp32, bsums (M, nb, 16)) of fp32 x (M, K) as llama.cpp's q8_K."""
    xb = x.astype(F32).reshape(x.shape[0], -1, 256)
    top = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)  # argmax: the first of equal magnitudes
    safe = np.where(top != 0, top, F32(1))
    iscale = F32(-127) / safe
    codes = np.where(top != 0, np.minimum(np.rint(iscale * xb), 127), 0).astype(np.int64)  # rint: half to even
    d = np.where(top != 0, F32(1) / iscale, F32(0))[..., 0].astype(F32)
    return codes, d, codes.reshape(*codes.shape[:2], 16, 16).sum(-1)


def integer_parts(blocks: np.ndarray, kind: str):
    """(scaled codes, -mins per value or None, d, dmin) of (N, nb, bytes) blocks: gguf's dequantization of the same
    blocks with d = 1, dmin = 0 (and d = 0, dmin = 1), exact small integers in fp32."""
    nbytes, at_d, at_m = LAYOUT[kind]
    qt = gguf.GGMLQuantizationType[kind]
    half = lambda at: blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(F32)  # noqa: E731

    def with_scales(d, dmin):
        b = blocks.copy()
        b[..., at_d : at_d + 2] = np.array([d], np.float16).view(np.uint8)
        if at_m is not None:
            b[..., at_m : at_m + 2] = np.array([dmin], np.float16).view(np.uint8)
        w = gguf.quants.dequantize(b.reshape(-1, nbytes), qt).reshape(*blocks.shape[:2], 256)
        assert np.array_equal(w, np.round(w))
        return w.astype(np.int64)

    return (with_scales(1.0, 0.0), with_scales(0.0, 1.0) if at_m is not None else None, half(at_d),
            half(at_m) if at_m is not None else None)


def q6k_unsigned(blocks: np.ndarray, scaled: np.ndarray):
    """Q6_K's scaled codes without the -32 offset, and the offsets as llama.cpp's AVX2 dot takes them per lane."""
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.int64)  # (N, nb, 16): one scale per 16 values
    return scaled + 32 * np.repeat(sc, 16, axis=-1), sc


def lanes(v: np.ndarray) -> np.ndarray:
    """(..., 256) integers summed into llama.cpp's AVX2 int32 lanes: value i goes to lane (i % 32) // 4."""
    return v.reshape(*v.shape[:-1], 8, 8, 4).sum(axis=(-3, -1))


def fma(a, b, c):
    """fp32 fused multiply-add (exact product and sum in fp64, one rounding to fp32)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def hsum8(acc: np.ndarray) -> np.ndarray:
    """llama.cpp's hsum_float_8 (and ours): ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) in fp32."""
    s = acc[..., :4] + acc[..., 4:]
    return (s[..., 0] + s[..., 2]) + (s[..., 1] + s[..., 3])


def llama_cpp_product(x: np.ndarray, blocks: np.ndarray, kind: str):
    """(y (M, N) in fp32 in llama.cpp's order, y in fp64, a bound on |fp32 - fp64|) of x times blocks."""
    codes, dx, bsums = q8_k(x)
    scaled, mins, d, dmin = integer_parts(blocks, kind)
    S = np.einsum("mbk,nbk->mnb", codes, scaled)  # exact int64 per (row, output, super-block)
    dd = d[None] * dx[:, None]  # fp32 products, as llama.cpp forms them (fp16 d times q8_K's d)
    terms = dd.astype(np.float64) * S
    size = np.abs(dd.astype(np.float64)) * np.einsum("mbk,nbk->mnb", np.abs(codes), np.abs(scaled))
    if mins is not None:
        dm = dmin[None] * dx[:, None]
        terms = terms + dm.astype(np.float64) * np.einsum("mbk,nbk->mnb", codes, mins)
        size = size + np.abs(dm.astype(np.float64)) * np.einsum("mbk,nbk->mnb", np.abs(codes), np.abs(mins))
    exact = terms.sum(-1)
    bound = size.sum(-1) * (S.shape[-1] + 8) * 2.0**-24  # fp32 rounding of the block scales, lanes and sums
    M, N, nb = S.shape
    if kind in ("Q4_K", "Q2_K"):  # llama.cpp's repacked q4_K_8x8 (q2_K_8x8 on AVX-512): acc = fma(sum, d dx, acc)
        msum = np.einsum("mbk,nbk->mnb", codes, -mins)
        acc, accm = np.zeros((M, N), F32), np.zeros((M, N), F32)
        for b in range(nb):
            acc = fma(S[..., b].astype(F32), dd[..., b], acc)
            accm = fma(msum[..., b].astype(F32), dm[..., b], accm)
        return acc - accm, exact, bound
    # its AVX2 dots: 8 int32 lanes, each fma(d dx, lane, acc); Q6_K takes its -32 offsets off lane by lane
    if kind == "Q6_K":
        unsigned, sc = q6k_unsigned(blocks, scaled)
        L = lanes(codes[:, None] * unsigned[None]) - 32 * (bsums[:, None] * sc[None]).reshape(M, N, nb, 8, 2).sum(-1)
    else:
        L = lanes(codes[:, None] * scaled[None])
    acc, summs = np.zeros((M, N, 8), F32), np.zeros((M, N), F32)
    for b in range(nb):
        acc = fma(L[:, :, b].astype(F32), dd[..., b, None], acc)
        if kind == "Q5_K":  # the mins in one fp32 sum: summs += (-dmin dx) * sum (contracted to an fma)
            summs = fma(-dm[..., b], np.einsum("mk,nk->mn", codes[:, b], -mins[:, b]).astype(F32), summs)
    return hsum8(acc) + summs, exact, bound


def activations(M: int, K: int, seed: int) -> np.ndarray:
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[1] *= 40.0  # rows of very different ranges
    x[2, :300] = 0.0  # an all-zero super-block
    x[3, 5], x[3, 9] = -7.0, 7.0  # equal magnitudes: the first one's sign sets iscale's
    return x.numpy()


@pytest.mark.parametrize("avx512", ["1", "0"])  # the AVX-512 VNNI copy where the CPU has it, and the AVX2 copy
@pytest.mark.parametrize("kind", list(LAYOUT))
def test_super_block_products_follow_llama_cpps_q8_k_arithmetic(kind, avx512, monkeypatch):
    monkeypatch.setenv("LLAMA_CPU_AVX512", avx512)  # read by the kernel on every call
    K, N, M = 1280, 24, 5
    blocks = random_blocks(kind, N, K, seed=2)
    x = activations(M, K, seed=3)
    ours = cpu.gguf_linear(torch.from_numpy(x), torch.from_numpy(blocks), int(gguf.GGMLQuantizationType[kind]))
    ordered, exact, bound = llama_cpp_product(x, blocks.reshape(N, K // 256, -1), kind)
    assert (np.abs(ours.numpy().astype(np.float64) - exact) <= bound).all(), kind
    assert np.array_equal(ours.numpy(), ordered), (kind, np.abs(ours.numpy() - ordered).max())
