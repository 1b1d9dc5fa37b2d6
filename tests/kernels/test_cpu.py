"""Our CPU kernels (llama/kernels/cpu.py): each against a float64 reference of what it computes (the dequantized
weight times the block-quantized activations), every row of a batch equal to that row alone (bitwise), every
path of the int4 kernel (group 32 in vectors of 8 blocks, other groups, partial vectors), both tiles of the int4
and int8 kernels (AVX2, and AVX-512 VNNI where the CPU has it) and of bf16 products (AVX2 in fp32, and AVX-512 BF16
dot products where the CPU has them), the decode attention op against the model's eager
step, the weights dequantized to bf16 for a long prefill and the products routed to oneDNN by row count, shapes
refused by name, the build kept and reused, and the fallback to PyTorch's kernels when turned off."""

import os
import subprocess
import sys

import hardware
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

from llama.kernels import cpu
from llama.model import apply_rotary, rope_tables
from llama.quantization.int4 import dequantize_codes, quantize_codes
from llama.quantization.int8 import quantize_weight

pytestmark = hardware.KERNELS

BATCHES = (1, 2, 3, 5, 8, 9)  # tiles of 4 rows: whole, partial and mixed; bf16: one pass of up to 8 rows


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


VNNI = all(torch.cpu.get_capabilities().get(f"avx512_{f}", False) for f in ("f", "bw", "dq", "vl", "vnni"))


@pytest.fixture(params=["avx2", "avx512-vnni"])
def tile(request, monkeypatch):
    """Each tile of the int4 and int8 kernels in turn: AVX2, and AVX-512 VNNI (rows of 8-block multiples, where the
    CPU has it)."""
    if request.param == "avx512-vnni" and not VNNI:
        pytest.skip("hardware: this CPU has no AVX-512 VNNI")
    monkeypatch.setenv("LLAMA_CPU_AVX512", "0" if request.param == "avx2" else "1")
    return request.param


@pytest.mark.parametrize("n, k, g", [(48, 256, 32), (40, 64, 32), (24, 96, 32), (33, 512, 64), (16, 256, 128),
                                     (20, 512, 256), (8, 320, 64), (12, 768, 64)])  # 320 / 64: a partial
def test_int4_is_the_dequantized_product(n, k, g, tile):  # last group; 768 / 64: 12 groups over 24 blocks
    torch.manual_seed(n + k + g)
    w = torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None]
    codes, scales = quantize_codes(w, g)
    weight = dequantize_codes(codes, scales, g).double()
    for m in BATCHES:
        x = torch.randn(m, k) * 3
        x[0, :32] = 0  # an all-zero block
        check_rows(lambda v: torch.ops.llama_cpu.int4_linear(v, codes, scales, g), x,
                   block_dequantized(x).double() @ weight.T)


@pytest.mark.parametrize("n, k", [(48, 256), (24, 96), (7, 4096)])  # 96: 3 blocks, the AVX2 tile only
def test_int8_is_the_dequantized_product(n, k, tile):
    torch.manual_seed(n + k)
    q, scales = quantize_weight(torch.randn(n, k), torch.float32)
    weight = (q.double() * scales.double()[:, None])
    for m in BATCHES:
        x = torch.randn(m, k)
        check_rows(lambda v: torch.ops.llama_cpu.int8_linear(v, q, scales), x, block_dequantized(x).double() @ weight.T)


BF16_DOT = all(torch.cpu.get_capabilities().get(f"avx512_{f}", False) for f in ("f", "bw", "vl", "bf16"))


@pytest.fixture(params=["avx2", "avx512-bf16"])
def float_tile(request, monkeypatch):
    """Each tile of float_linear for bf16 weights and activations in turn: AVX2 (in fp32), and AVX-512 BF16 dot
    products where the CPU has them."""
    if request.param == "avx512-bf16" and not BF16_DOT:
        pytest.skip("hardware: this CPU has no AVX-512 BF16")
    monkeypatch.setenv("LLAMA_CPU_AVX512", "0" if request.param == "avx2" else "1")
    return request.param


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("n, k", [(48, 256), (24, 100), (5, 13), (9, 4160)])  # tails shorter than a vector
def test_float_weights_are_the_float_product(n, k, x_dtype, w_dtype, float_tile):
    """Exact products of the given values summed in fp32: bf16 activations are never rounded further."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k).to(w_dtype)
    for m in BATCHES:
        x = torch.randn(m, k).to(x_dtype)
        check_rows(lambda v: torch.ops.llama_cpu.float_linear(v, w), x, x.double() @ w.double().T)


@pytest.mark.skipif(not BF16_DOT, reason="hardware: int4_to_bf16 and int8_to_bf16 need AVX-512 BF16")
@pytest.mark.parametrize("n, k, g", [(48, 256, 32), (33, 512, 64), (20, 512, 256), (16, 320, 128), (12, 768, 64)])
def test_to_bf16_is_the_dequantized_weight_rounded(n, k, g):  # 320 / 128: a partial last group
    torch.manual_seed(n + k)
    w = torch.randn(n, k)
    codes, scales = quantize_codes(w, g)
    assert torch.equal(torch.ops.llama_cpu.int4_to_bf16(codes, scales, g), dequantize_codes(codes, scales, g).bfloat16())
    q8, s8 = quantize_weight(w, torch.float32)
    assert torch.equal(torch.ops.llama_cpu.int8_to_bf16(q8, s8), (q8.float() * s8[:, None]).bfloat16())


def test_quantized_prefill_takes_onednn_on_the_dequantized_weight(monkeypatch):
    """Past QUANT_KERNEL_MAX_ROWS rows, where oneDNN has bf16 dot products, an int4 or int8 product is oneDNN's bf16
    GEMM on the weight dequantized to bf16, slice by slice (here 16 weight rows a slice, the last partial); up to it,
    and everywhere without them, our kernel's product."""
    monkeypatch.setattr(cpu, "SLICE_BYTES", 2048)
    torch.manual_seed(0)
    n, k, g = 40, 256, 32
    w = torch.randn(n, k)
    codes, scales = quantize_codes(w, g)
    q8, s8 = quantize_weight(w, torch.float32)
    kinds = {"int4": (lambda v: cpu.int4_linear(v, codes, scales, g),
                      lambda v: torch.ops.llama_cpu.int4_linear(v, codes, scales, g), dequantize_codes(codes, scales, g)),
             "int8": (lambda v: cpu.int8_linear(v, q8, s8),
                      lambda v: torch.ops.llama_cpu.int8_linear(v, q8, s8), q8.float() * s8[:, None])}
    for name, (product, kernel, dequantized) in kinds.items():
        for rows in (1, cpu.QUANT_KERNEL_MAX_ROWS, cpu.QUANT_KERNEL_MAX_ROWS + 1, 80):
            x = torch.randn(2, rows // 2, k) if rows % 2 == 0 else torch.randn(rows, k)  # (B, T, dim) as a prefill's
            y = product(x)
            assert y.shape == (*x.shape[:-1], n) and y.dtype == x.dtype
            flat = x.reshape(-1, k)
            if rows > cpu.QUANT_KERNEL_MAX_ROWS and cpu.onednn_bf16():
                want = F.linear(flat.bfloat16(), dequantized.bfloat16()).float()
            else:
                want = kernel(flat)
            assert torch.equal(y.reshape(-1, n), want), (name, rows)
            torch.testing.assert_close(y.reshape(-1, n).double(), flat.double() @ dequantized.double().T, rtol=0,
                                       atol=0.5)  # outputs ~16; int8 activation blocks err by up to ~0.3


def test_many_rows_take_the_weights_in_chunks(tile):
    """Past one tile of rows, weight rows are taken in L2-sized chunks (here 8 rows of 16 KB): same sums, bitwise,
    as each row alone, for every kernel."""
    torch.manual_seed(0)
    n, k = 70, 4096
    w = torch.randn(n, k)
    q8, s8 = quantize_weight(w, torch.float32)
    codes, s4 = quantize_codes(w, 32)
    x = torch.randn(11, k)
    xb, wb = x.bfloat16(), w.bfloat16()
    ops = {"fp32": (lambda v: torch.ops.llama_cpu.float_linear(v, w), x.double() @ w.double().T),
           "bf16": (lambda v: torch.ops.llama_cpu.float_linear(v.bfloat16(), wb), xb.double() @ wb.double().T),
           "int8": (lambda v: torch.ops.llama_cpu.int8_linear(v, q8, s8),
                    block_dequantized(x).double() @ (q8.double() * s8.double()[:, None]).T),
           "int4": (lambda v: torch.ops.llama_cpu.int4_linear(v, codes, s4, 32),
                    block_dequantized(x).double() @ dequantize_codes(codes, s4, 32).double().T)}
    for name, (op, ref) in ops.items():
        check_rows(op, x, ref)


def reference_decode_attention(q, k, v, cos, sin, cache_k, cache_v, rows, positions, kv_len):
    """What the model's eager path computes for one token per row: apply_rotary, the cache write, SDPA under the
    position mask."""
    B, D = q.shape[0], cache_k.shape[-1]
    H, Hkv = q.shape[1] // D, cache_k.shape[1]
    index = torch.arange(B) if rows is None else rows
    pos = positions.expand(B)
    qr = apply_rotary(q.reshape(B, 1, H, D), cos.view(-1, 1, D // 2), sin.view(-1, 1, D // 2))
    kr = apply_rotary(k.reshape(B, 1, Hkv, D), cos.view(-1, 1, D // 2), sin.view(-1, 1, D // 2))
    cache_k[index, :, pos] = kr[:, 0]
    cache_v[index, :, pos] = v.reshape(B, Hkv, D)
    mask = (torch.arange(kv_len)[None] <= pos[:, None])[:, None, None]
    out = F.scaled_dot_product_attention(qr.transpose(1, 2), cache_k[index, :, :kv_len], cache_v[index, :, :kv_len],
                                         attn_mask=mask, enable_gqa=H != Hkv)
    return out.transpose(1, 2).reshape(B, H * D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, rows, positions", [
    (8, 8, 64, None, [11]),            # one row at the newest position
    (8, 2, 16, [3, 0, 4], [5, 17, 3]),  # grouped queries, chosen cache rows, a position per row
    (4, 4, 128, "slice", [9]),          # an engine group's consecutive rows, one shared position
])
def test_decode_attention_is_the_eager_step(dtype, heads, kv_heads, head_dim, rows, positions):
    """Rotation and cache writes bitwise as the model's eager path; attention within rounding of SDPA; each row
    alone gives the same output bitwise (batch == solo)."""
    torch.manual_seed(heads + head_dim)
    B = 3 if rows == "slice" or (rows and len(rows) == 3) else 1
    S = 24
    cache_k, cache_v = torch.randn(6, kv_heads, S, head_dim).to(dtype), torch.randn(6, kv_heads, S, head_dim).to(dtype)
    qkv = torch.randn(B, (heads + 2 * kv_heads) * head_dim).to(dtype)  # strided views into one product, as fused
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    pos = torch.tensor(positions)
    cos_t, sin_t = rope_tables(head_dim, 2 * S)
    cos, sin = cos_t[pos], sin_t[pos]
    kv_len = int(pos.max()) + 1
    row_arg = slice(2, 2 + B) if rows == "slice" else (None if rows is None else torch.tensor(rows))
    ref_rows = torch.arange(2, 2 + B) if rows == "slice" else row_arg
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    want = reference_decode_attention(q, k, v, cos, sin, ref_k, ref_v, ref_rows, pos, kv_len)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    got = cpu.decode_attention(q, k, v, cos, sin, cache_k, cache_v, row_arg, pos, kv_len)
    assert torch.equal(cache_k, ref_k) and torch.equal(cache_v, ref_v)
    assert got.dtype == dtype and got.shape == want.shape
    tol = dict(rtol=0, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1.6e-2)  # bf16: one ulp near 2
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if B > 1:
        for b in range(B):
            ck, cv = before_k.clone(), before_v.clone()
            one_rows = ref_rows[b : b + 1]
            one_pos = pos[b : b + 1] if len(pos) > 1 else pos
            alone = cpu.decode_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], cos[b : b + 1] if len(pos) > 1
                                                 else cos, sin[b : b + 1] if len(pos) > 1 else sin, ck, cv, one_rows,
                                                 one_pos, kv_len)
            assert torch.equal(alone, got[b : b + 1])


def test_decode_attention_refuses_bad_inputs_by_name():
    cache = torch.zeros(2, 2, 8, 12)
    q, kv = torch.zeros(1, 24), torch.zeros(1, 24)
    cos = sin = torch.zeros(1, 6)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 8, got 12"):
        cpu.decode_attention(q, kv, kv, cos, sin, cache, cache.clone(), None, torch.tensor([0]), 1)
    cache = torch.zeros(2, 2, 8, 16)
    q, kv, cos = torch.zeros(1, 32), torch.zeros(1, 32), torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="position 8 outside the cache's 8"):
        cpu.decode_attention(q, kv, kv, cos, cos, cache, cache.clone(), None, torch.tensor([8]), 8)
    with pytest.raises(RuntimeError, match="row 2 outside the cache's 2"):
        cpu.decode_attention(q, kv, kv, cos, cos, cache, cache.clone(), torch.tensor([2]), torch.tensor([0]), 1)
    with pytest.raises(RuntimeError, match="in the cache's dtype"):
        cpu.decode_attention(q.bfloat16(), kv, kv, cos, cos, cache, cache.clone(), None, torch.tensor([0]), 1)


def test_wrappers_keep_shape_and_dtype():
    w = torch.randn(16, 64)
    codes, scales = quantize_codes(w, 32)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    for y in (cpu.int4_linear(x, codes, scales, 32), cpu.float_linear(x, w.bfloat16()),
              cpu.int8_linear(x, *quantize_weight(w, torch.float32))):
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
    with pytest.raises(RuntimeError, match=r"x must be contiguous float32 or bf16 of shape \(M, 64\)"):
        torch.ops.llama_cpu.float_linear(torch.randn(1, 64).half(), torch.randn(16, 64).bfloat16())


def test_built_once_and_turned_off_by_env(tmp_path):
    """With the package's own build current (pip install built it), a fresh cache compiles nothing and stays
    empty; without it (a source edited since the install), the first process builds into the cache and a second
    loads that. LLAMA_CPU_KERNELS=0 falls back to PyTorch's kernels, and an int4 model still runs (in aten's
    layout)."""
    from llama.kernels import build

    code = ("import torch; from llama.kernels import cpu; from llama.quantization.int4 import quantize_int4;"
            "from test_model import random_model;"
            "m = quantize_int4(random_model().fuse(), 32); m(torch.randint(0, 96, (1, 4)), 0);"
            "print(cpu.available(), m.output.method.ours and m.output.method.group_size or None)")
    env = {**os.environ, "LLAMA_CACHE": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def run(**extra):
        done = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stderr
        return done

    first = run()
    assert first.stdout.split()[-2:] == ["True", "32"]
    if build.packaged(build.CPU_KERNELS, build.compiler()) is not None:
        assert "compiling" not in first.stderr and not list(tmp_path.glob("kernels/**/*.so")), first.stderr
    else:
        assert "compiling cpu_kernels" in first.stderr
        assert len(list(tmp_path.glob("kernels/cpu/cpu.so"))) == 1
    second = run()
    assert "compiling" not in second.stderr and second.stdout.split()[-2:] == ["True", "32"]
    off = run(LLAMA_CPU_KERNELS="0")
    assert off.stdout.split()[-2:] == ["False", "None"]


def test_eager_products_take_our_kernel_or_fall_back(monkeypatch):
    """dense.linear sends eager CPU products of contiguous fp32 weights up to FP32_KERNEL_MAX_ROWS rows, and of
    bf16 ones up to BF16_KERNEL_MAX_ROWS (any number without native bf16), to float_linear; a strided weight (a
    row-parallel shard's view) still multiplies."""
    from llama.kernels.dense import BF16_KERNEL_MAX_ROWS, FP32_KERNEL_MAX_ROWS, linear

    torch.manual_seed(0)
    w = torch.randn(24, 64)
    for rows in (1, FP32_KERNEL_MAX_ROWS, FP32_KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        want = x.double() @ w.double().T
        torch.testing.assert_close(linear(x, w).double(), want, rtol=1e-5, atol=1e-4)
        if rows <= FP32_KERNEL_MAX_ROWS:
            assert torch.equal(linear(x, w), torch.ops.llama_cpu.float_linear(x, w))
    # bf16: our kernel up to BF16_KERNEL_MAX_ROWS rows (a decode step, a short prompt); past that, oneDNN's GEMM
    # where the CPU has bf16 dot products (cpu.onednn_bf16()), our kernel where it has not.
    float_linear, wb, calls = cpu.float_linear, w.bfloat16(), []
    monkeypatch.setattr(cpu, "float_linear", lambda *a: calls.append(1) or float_linear(*a))
    for rows in (1, BF16_KERNEL_MAX_ROWS, BF16_KERNEL_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 64).bfloat16()
        calls.clear()
        y = linear(x, wb)
        assert len(calls) == (0 if rows > BF16_KERNEL_MAX_ROWS and cpu.onednn_bf16() else 1), rows
        torch.testing.assert_close(y.float(), x.float() @ wb.float().T, rtol=1e-2, atol=2e-2)
    strided = torch.randn(24, 128)[:, ::2]
    x = torch.randn(2, 64)
    torch.testing.assert_close(linear(x, strided).double(), x.double() @ strided.double().T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x.bfloat16(), strided.bfloat16()).float(),
                               (x.bfloat16().float() @ strided.bfloat16().float().T), rtol=2e-2, atol=5e-2)
