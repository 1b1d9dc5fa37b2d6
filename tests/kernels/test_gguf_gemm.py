"""The many-row GGUF product (llama/kernels/csrc/gguf_gemm.cpp, a prompt's prefill) gives every row the one-row
product's result bit for bit, on both copies of its inner loops (AVX2 and AVX-512 VNNI), for every format it takes:
a request's output does not depend on how many rows share its product. (The 32-value formats' many-row products
are gguf_rows.h's, tested in test_gguf_rows.py; Q4_K_X8's, test_gguf_x8.py.)"""

import hardware
import pytest
import torch
from gguf_blocks_data import random_blocks

from llama.kernels import cpu
pytestmark = hardware.KERNELS

GEMM = ["Q4_K", "Q6_K", "Q5_K", "IQ4_XS", "Q2_K", "Q3_K"]  # gguf_gemm.cpp's takes_gemm
VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu.cpu_flags()


def qtype(kind):
    import gguf

    return int(gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", GEMM)
def test_many_rows_equal_one_row_at_a_time_bitwise(kind, monkeypatch):
    # 13 rows: whole row tiles and a remainder; 37 outputs: two panels of 16 and a part panel with an odd column
    K, N, M = 768, 37, 13
    w = torch.from_numpy(random_blocks(kind, N, K, seed=11))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(12))
    x[2] *= 300.0  # rows of very different ranges
    x[5, :256] = 0.0  # all-zero blocks
    for avx512 in (["1", "0"] if VNNI else ["0"]):
        monkeypatch.setenv("LLAMA_CPU_AVX512", avx512)  # read by the kernels on every call
        many = cpu.gguf_linear(x, w, qtype(kind))
        for i in range(M):
            one = cpu.gguf_linear(x[i : i + 1], w, qtype(kind))[0]
            assert torch.equal(many[i], one), (kind, avx512, i, (many[i] - one).abs().max().item())
