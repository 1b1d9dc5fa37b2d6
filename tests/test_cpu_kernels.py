"""Our CPU kernels (llama/cpu_kernels.py): each against a float64 reference of what it computes (the dequantized
weight times the block-quantized activations), every row of a batch equal to that row alone (bitwise), every
path of the int4 kernel (group 32 in vectors of 8 blocks, other groups, partial vectors), shapes refused by name,
the build kept and reused, and the fallback to PyTorch's kernels when turned off."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from llama import cpu_kernels
from llama.quant_int4 import dequantize_codes, quantize_codes
from llama.quantize import quantize_weight

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="llama's CPU kernels need x86-64 with AVX2/FMA and a C++ compiler")

BATCHES = (1, 2, 3, 5, 9)  # tiles of 4 rows: whole, partial and mixed


def block_dequantized(x: torch.Tensor) -> torch.Tensor:
    """x as the quantized kernels see it: blocks of 32 with scale amax / 127, codes rounded half to even."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0)
    assert codes.abs().max() <= 127
    return (codes * d).view(m, k)


def check_rows(op, x: torch.Tensor, ref: torch.Tensor) -> None:
    y = op(x)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for i in range(x.shape[0]):
        assert torch.equal(op(x[i : i + 1].contiguous()), y[i : i + 1])


@pytest.mark.parametrize("n, k, g", [(48, 256, 32), (40, 64, 32), (24, 96, 32), (33, 512, 64), (16, 256, 128),
                                     (20, 512, 256), (8, 320, 64)])  # 320 / 64: a partial last group
def test_int4_is_the_dequantized_product(n, k, g):
    torch.manual_seed(n + k + g)
    w = torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None]
    codes, scales = quantize_codes(w, g)
    weight = dequantize_codes(codes, scales, g).double()
    for m in BATCHES:
        x = torch.randn(m, k) * 3
        x[0, :32] = 0  # an all-zero block
        check_rows(lambda v: torch.ops.llama_cpu.int4_linear(v, codes, scales, g), x,
                   block_dequantized(x).double() @ weight.T)


@pytest.mark.parametrize("n, k", [(48, 256), (24, 96), (7, 4096)])
def test_int8_is_the_dequantized_product(n, k):
    torch.manual_seed(n + k)
    q, scales = quantize_weight(torch.randn(n, k), torch.float32)
    weight = (q.double() * scales.double()[:, None])
    for m in BATCHES:
        x = torch.randn(m, k)
        check_rows(lambda v: torch.ops.llama_cpu.int8_linear(v, q, scales), x, block_dequantized(x).double() @ weight.T)


@pytest.mark.parametrize("n, k", [(48, 256), (24, 100), (5, 13)])  # 100, 13: tails shorter than a vector
def test_bf16_is_the_float_product(n, k):
    torch.manual_seed(n + k)
    w = torch.randn(n, k).bfloat16()
    for m in BATCHES:
        x = torch.randn(m, k)
        check_rows(lambda v: torch.ops.llama_cpu.bf16_linear(v, w), x, x.double() @ w.double().T)


def test_wrappers_keep_shape_and_dtype():
    w = torch.randn(16, 64)
    codes, scales = quantize_codes(w, 32)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    for y in (cpu_kernels.int4_linear(x, codes, scales, 32), cpu_kernels.bf16_linear(x, w.bfloat16()),
              cpu_kernels.int8_linear(x, *quantize_weight(w, torch.float32))):
        assert y.shape == (2, 3, 16) and y.dtype == torch.bfloat16


def test_bad_shapes_are_named():
    codes, scales = quantize_codes(torch.randn(16, 64), 32)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        torch.ops.llama_cpu.int4_linear(torch.randn(1, 32), codes, scales, 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q, s = quantize_weight(torch.randn(4, 48), torch.float32)
        torch.ops.llama_cpu.int8_linear(torch.randn(1, 48), q, s)
    with pytest.raises(RuntimeError, match=r"scales must be contiguous bf16 of shape \(16, 2, 2\)"):
        torch.ops.llama_cpu.int4_linear(torch.randn(1, 64), codes, scales.float(), 32)
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        torch.ops.llama_cpu.bf16_linear(torch.randn(1, 64).bfloat16(), torch.randn(16, 64).bfloat16())


def test_built_once_and_turned_off_by_env(tmp_path):
    """A fresh cache builds the library once; a second process loads it; LLAMA_CPU_KERNELS=0 falls back to
    PyTorch's kernels, and an int4 model still runs (in aten's layout)."""
    code = ("import torch; from llama import cpu_kernels; from llama.quant_int4 import quantize_int4;"
            "from test_model import random_model;"
            "m = quantize_int4(random_model().fuse(), 32); m(torch.randint(0, 96, (1, 4)), 0);"
            "print(cpu_kernels.available(), m.output.int4_group)")
    env = {**os.environ, "LLAMA_CACHE": str(tmp_path), "PYTHONPATH": str(REPO / "tests")}

    def run(**extra):
        done = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stderr
        return done

    first = run()
    assert "compiling llama's CPU kernels" in first.stderr and first.stdout.split()[-2:] == ["True", "32"]
    libs = list(tmp_path.glob("kernels/*/cpu_kernels.so"))
    assert len(libs) == 1
    second = run()
    assert "compiling" not in second.stderr and second.stdout.split()[-2:] == ["True", "32"]
    off = run(LLAMA_CPU_KERNELS="0")
    assert off.stdout.split()[-2:] == ["False", "None"]
