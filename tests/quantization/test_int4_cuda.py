"""int4 on CUDA (llama/quantization/int4_cuda.py): tinygemm's inputs dequantize to the storage layout's weights
(checked on any machine, by the kernel's documented rule), and on a GPU its products, quantize="int4" and stored
int4 checkpoints."""

import pytest
import torch
from conftest import STORIES, need

from llama import Llama
from llama.hub.demo import write_random_checkpoint
from llama.quantization.cli import quantize_checkpoint
from llama.quantization.int4 import dequantize_codes, quantize_codes
from llama.quantization.int4_cuda import (
    Int4Cuda,
    int4_linear,
    kernel_inputs,
    to_cuda_kernel,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="hardware: needs a CUDA device (tinygemm is a CUDA kernel)")


def tinygemm_weight(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The (N', K') weight tinygemm computes with, by its rule: even input from the high nibble, odd from the low,
    (code - 8) * scale + zero per group."""
    codes = torch.stack([q >> 4, q & 15], dim=-1).view(q.shape[0], -1).float()
    group = codes.shape[1] // sz.shape[0]
    s = sz.float().transpose(0, 1).repeat_interleave(group, dim=1)  # (N', K', 2)
    return (codes - 8) * s[..., 0] + s[..., 1]


@pytest.mark.parametrize("n, k, g", [(64, 256, 32), (20, 96, 32), (48, 320, 64), (8, 256, 256), (40, 72, 32)])
def test_kernel_inputs_dequantize_to_the_storage_weights(n, k, g):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    codes, scales = quantize_codes(w, g)
    q, sz = kernel_inputs(codes, scales, g)
    assert q.shape[0] % 8 == 0 and (q.shape[1] * 2) % 128 == 0 and (q.shape[1] * 2) % g == 0
    full = tinygemm_weight(q, sz)
    torch.testing.assert_close(full[:n, :k], dequantize_codes(codes, scales, g), rtol=0, atol=0)
    assert not full[n:].any()  # padded rows: scale and zero 0


def test_kernel_inputs_refuse_mismatched_scales():
    codes, scales = quantize_codes(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match="do not fit"):
        kernel_inputs(codes, scales[:, :1], 32)


@CUDA
@pytest.mark.parametrize("n, k, g", [(256, 512, 32), (40, 96, 32), (128, 4096, 128)])
def test_cuda_product_is_the_dequantized_product_and_rows_are_independent(n, k, g):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    codes, scales = quantize_codes(w, g)
    packed, sz = to_cuda_kernel(codes.cuda(), scales.cuda(), g)
    x = torch.randn(5, k, device="cuda").to(torch.bfloat16)
    ref = x.float() @ dequantize_codes(codes, scales, g).cuda().T
    y = int4_linear(x, packed, sz, n)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    solo = torch.cat([int4_linear(x[i : i + 1], packed, sz, n) for i in range(5)])
    torch.testing.assert_close(solo, y, rtol=0, atol=0)


@CUDA
def test_quantize_int4_on_cuda_follows_cpu_int4(tmp_path):
    tok = str(need(STORIES / "tokenizer.model"))
    params = {"dim": 128, "n_layers": 2, "n_heads": 4, "vocab_size": 512, "multiple_of": 32, "norm_eps": 1e-5}
    ckpt = write_random_checkpoint(tmp_path / "ckpt", params, seed=5, std=0.05)
    gpu = Llama.build(str(ckpt), tok, 64, 2, quantize="int4", device="cuda", dtype=torch.bfloat16, compile=False)
    layers = [m for m in gpu.model.modules() if getattr(m, "method", None) is not None and m.method.quantized]
    assert layers and all(isinstance(m.method, Int4Cuda) for m in layers)
    cpu = Llama.build(str(ckpt), tok, 64, 2, quantize="int4", device="cpu", dtype=torch.bfloat16, compile=False)
    tokens = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    a, b = gpu.model(tokens.cuda(), 0).float().cpu(), cpu.model(tokens, 0).float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(a, b, rtol=0.1, atol=0.1 * b.abs().max().item())


@CUDA
def test_stored_int4_checkpoint_loads_on_cuda(tmp_path):
    """The stored codes load into tinygemm's layout (nothing requantized) and give the CPU load's logits to bf16
    rounding. (Quantizing on the GPU may pick other codes: the search's float arithmetic differs there.)"""
    tok = str(need(STORIES / "tokenizer.model"))
    params = {"dim": 128, "n_layers": 2, "n_heads": 4, "vocab_size": 512, "multiple_of": 32, "norm_eps": 1e-5}
    ckpt = write_random_checkpoint(tmp_path / "ckpt", params, seed=6, std=0.05)
    quantize_checkpoint(ckpt, tmp_path / "q", "int4")
    gpu = Llama.build(str(tmp_path / "q"), tok, 64, 2, device="cuda", dtype=torch.bfloat16, compile=False)
    assert all(isinstance(m.method, Int4Cuda) for m in gpu.model.modules()
               if getattr(m, "method", None) is not None and m.method.quantized)
    cpu = Llama.build(str(tmp_path / "q"), tok, 64, 2, device="cpu", dtype=torch.bfloat16, compile=False)
    tokens = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    a, b = gpu.model(tokens.cuda(), 0).float().cpu(), cpu.model(tokens, 0).float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(a, b, rtol=0.1, atol=0.1 * b.abs().max().item())
