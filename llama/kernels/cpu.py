"""Our own CPU kernels (llama/kernels/csrc/: matrix-vector products, a decode step's attention and RMSNorm), built at
install (or on first use) and kept on disk.

Why: on AVX2 CPUs PyTorch's kernels for the weights decoding reads stream them well below the memory's rate (its
int4 GEMM, bf16 GEMV and int8 GEMM; docs/performance.md), and batch-1 decode speed is that rate. The kernels
multiply int8 activation codes by int8 or int4 weight codes as llama.cpp does, and bf16 or fp32 weights in fp32.
Two more ops do a decode step's attention (rotary embedding, cache write and attention over the cached positions)
and RMSNorm, each in one call instead of many small ones, and one runs a decode step's layers whole from all of
these (llama/kernels/fused_decode.py).

The library is compiled with the system's C++ compiler against the installed PyTorch by `pip install` into the
package (llama/kernels/build.py: one object per source, in parallel); where that build is missing or stale (no
compiler at install, a source edited since, another PyTorch) the first use builds it into
`$LLAMA_CACHE/kernels/cpu/` (default ~/.cache/llama), recompiling only the sources that changed; later processes
load it in milliseconds. Where it cannot be had (no AVX2/FMA/F16C, no compiler, a failed build, or
`LLAMA_CPU_KERNELS=0`) every caller falls back to PyTorch's kernels; an x86 CPU that was expected to run them
prints one line on stderr saying why.
"""

import platform
import sys
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F

from llama import settings
from llama.kernels import build, invariant
from llama.settings import cache_dir

BLOCK = 32  # activation block of the quantized kernels: inputs must be a multiple of it


def enabled() -> bool:
    return settings.get().cpu_kernels


def cpu_flags() -> set:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _note(why: str) -> None:
    print(f"note: llama's CPU kernels are not used ({why}); PyTorch's kernels run instead", file=sys.stderr)


def _compiler() -> Optional[str]:
    return build.compiler()


_loaded = False  # set once available() has loaded the ops: what torch.compile's tracing reads instead of calling it


@lru_cache(maxsize=None)
def available() -> bool:
    """Whether the kernels are loaded into torch.ops.llama_cpu (building them the first time on this machine)."""
    if not enabled():
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False  # other CPUs: PyTorch's kernels, as expected (no note)
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        _note("they need AVX2, FMA and F16C, which this CPU lacks")
        return False
    cxx = _compiler()
    if cxx is None:
        _note("no C++ compiler found: install g++ or set CXX")
        return False
    try:
        path = build.packaged(build.CPU_KERNELS, cxx)
        if path is None:  # no build at install, or a stale one: build (or reuse) the cache's
            path = build.locked_build(build.CPU_KERNELS, cache_dir() / "kernels" / "cpu", cxx)
        torch.ops.load_library(str(path))
    except Exception as e:  # a failed build or load costs speed, never the run
        _note(f"{e.__class__.__name__}: {e}")
        return False
    _register_fakes()
    global _loaded
    _loaded = True
    return True


def _register_fakes() -> None:
    """Shapes of the ops' results for torch.compile, which traces with tensors that hold no data."""
    def rows_out(x, n):
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    for name, fake in (("int4_linear", lambda x, codes, scales, group: rows_out(x, codes.shape[0])),
                       ("int8_linear", lambda x, weight, scales: rows_out(x, weight.shape[0])),
                       ("float_linear", lambda x, weight: rows_out(x, weight.shape[0])),
                       ("gguf_linear", lambda x, weight, type: rows_out(x, weight.shape[0])),
                       ("gguf_linear_float", lambda x, weight, type: rows_out(x, weight.shape[0])),
                       ("gguf_linear_x16", lambda x, weight, type: rows_out(x, weight.shape[0])),
                       ("gguf_unpack", lambda weight, type: weight.new_empty(
                           (weight.shape[0], gguf_values(type, weight.shape[1])), dtype=torch.float32)),
                       ("gguf_rows", lambda weight, ids, type: weight.new_empty(
                           (ids.numel(), gguf_values(type, weight.shape[1])), dtype=torch.float32))):
        try:
            torch.library.register_fake(f"llama_cpu::{name}")(fake)
        except RuntimeError:  # registered already (a second import path)
            pass


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()


@lru_cache(maxsize=None)
def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bf16 with the CPU's own bf16 dot products (AVX-512 BF16; every AMX CPU has it too).
    Without them it widens to fp32, and our kernels are faster at every size."""
    return torch.backends.mkldnn.is_available() and "avx512_bf16" in cpu_flags()


# Past this many rows (a prompt's prefill), an int4 or int8 product dequantizes its weight to bf16 a slice of
# SLICE_BYTES at a time and runs oneDNN's bf16 GEMM, where onednn_bf16(): faster than our kernels from about 48
# rows, 1.5x at 256 (docs/performance-history.md, "Prefill at 7B (2026-11-25)"). Ours are compute-bound there; at
# fewer rows they read the weights at the memory's rate, a quarter or half of the bytes of bf16.
QUANT_KERNEL_MAX_ROWS = 32
SLICE_BYTES = 8 << 20


def onednn_takes(x: torch.Tensor, max_rows: int) -> bool:
    """Whether a product of x goes to oneDNN's bf16 GEMM instead of our kernel: more than max_rows rows (a prompt's
    prefill), eager, where onednn_bf16()."""
    return onednn_rows(x.numel() // x.shape[-1], max_rows) and not torch.compiler.is_compiling()


def onednn_rows(rows: int, max_rows: int) -> bool:
    """onednn_takes for an eager product of `rows` rows. Never while row-invariant arithmetic is on
    (llama/kernels/invariant.py): our kernels sum each row in one order at any row count, oneDNN's GEMM does not."""
    return rows > max_rows and onednn_bf16() and not invariant.active()


def _dequantized_gemm(x: torch.Tensor, n: int, weight_rows) -> torch.Tensor:
    """x @ W.T with W (n, K) handed over as bf16 slices, weight_rows(n0, n1), each multiplied by oneDNN; result in
    x's dtype. The slices stay in cache between their dequantization and their product."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch.empty(rows.shape[0], n, dtype=x.dtype)
    step = max(16, SLICE_BYTES // (2 * rows.shape[1]))
    for n0 in range(0, n, step):
        y[:, n0 : n0 + step] = F.linear(rows, weight_rows(n0, min(n, n0 + step)))
    return y.view(*x.shape[:-1], n)


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """x @ W.T for an int4 weight in storage layout (llama/quantization/int4.py); result in x's dtype. Up to
    QUANT_KERNEL_MAX_ROWS rows (or without onednn_bf16()) in our kernel, with x quantized to int8 blocks; more rows in
    oneDNN's bf16 GEMM on the weight dequantized to bf16, with x rounded to bf16."""
    if onednn_takes(x, QUANT_KERNEL_MAX_ROWS):
        return _dequantized_gemm(x, codes.shape[0], lambda n0, n1: torch.ops.llama_cpu.int4_to_bf16(
            codes[n0:n1], scales[n0:n1], group_size))
    y = torch.ops.llama_cpu.int4_linear(_rows(x), codes, scales, group_size)
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ W.T for int8 weights with fp32 per-row scales, activations quantized in blocks of 32; past
    QUANT_KERNEL_MAX_ROWS rows, as int4_linear, oneDNN's bf16 GEMM on the weight times its scales rounded to bf16."""
    if onednn_takes(x, QUANT_KERNEL_MAX_ROWS):
        return _dequantized_gemm(x, weight.shape[0], lambda n0, n1: torch.ops.llama_cpu.int8_to_bf16(
            weight[n0:n1], scales[n0:n1]))
    y = torch.ops.llama_cpu.int8_linear(_rows(x), weight, scales)
    return y.view(*x.shape[:-1], -1).to(x.dtype)


# GGUF block formats our kernels run (llama/kernels/csrc/gguf_blocks.cpp): ggml type id -> (values, bytes) per block
GGUF_BLOCKS = {8: (32, 34), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 20: (32, 18), 12: (256, 144),
               13: (256, 176), 14: (256, 210), 23: (256, 136), 10: (256, 84), 11: (256, 110), 268: (256, 144)}
Q4_K_X8 = 0x100 | 12  # not a ggml type: Q4_K with its rows repacked 8 at a time (csrc/gguf_x8.h), our kernels' id


def gguf_values(qtype: int, row_bytes: int) -> int:
    """How many values a row of row_bytes bytes of GGUF blocks of type qtype holds."""
    values, nbytes = GGUF_BLOCKS[qtype]
    return row_bytes // nbytes * values


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """x @ W.T for W held as GGUF blocks of ggml type qtype, (N, row bytes) uint8; x quantized to int8 blocks as
    llama.cpp does (32 values for the 32-value formats, 256 for the K- and i-quants); result in x's dtype."""
    y = torch.ops.llama_cpu.gguf_linear(_rows(x), weight, qtype)
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def gguf_linear_float(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """x @ W.T for W held as GGUF blocks, each block decoded to fp32 in registers and multiplied by x in fp32
    (csrc/gguf_float.cpp): the dequantized file's product, with nothing quantized on the activations' side;
    result in x's dtype. Each row's result is the same at any batch size. A prompt's pass (x (B, T, dim) with T > 1)
    of more than GGUF_FLOAT_MAX_ROWS rows unpacks the weight to fp32 a slice at a time and multiplies it in a GEMM,
    faster there but not row-invariant: never while invariant.active(), and never for decode steps (T == 1) or
    their verify passes, whose rows must be bitwise the one-token step's at any batch size."""
    return _gguf_rows(x, weight, qtype, torch.ops.llama_cpu.gguf_linear_float)


def gguf_linear_x16(x: torch.Tensor, weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """x @ W.T for W held as GGUF blocks, x quantized to int16 in blocks of 32 (each by its largest magnitude) and
    multiplied by the weight codes widened to int16, summed exactly in int32 (csrc/gguf_x16.cpp): the dequantized
    file's product with the quantized activations, within 2^-16 of each activation block's largest value of the
    unquantized product, about 1.5x the fp32 path's speed on AVX2; result in x's dtype. Formats without an int16
    decoding run gguf_linear_float's arithmetic, and a prompt's pass of more than GGUF_FLOAT_MAX_ROWS rows its fp32
    GEMM, under its rules: the prompt's own activations, unquantized (as close to the file as fp32 activations are;
    a 128-token prompt's logits within 1e-3 of transformers', tests/formats/test_gguf_file.py)."""
    return _gguf_rows(x, weight, qtype, torch.ops.llama_cpu.gguf_linear_x16)


def _gguf_rows(x: torch.Tensor, weight: torch.Tensor, qtype: int, row_op) -> torch.Tensor:
    """row_op's product, or for a prompt's pass of many rows (while rows need not be invariant) the fp32 GEMM on
    unpacked slices."""
    rows = x.numel() // x.shape[-1]
    prompt = x.dim() == 3 and x.shape[1] > 1
    if prompt and rows > GGUF_FLOAT_MAX_ROWS and not invariant.active() and not torch.compiler.is_compiling():
        n = weight.shape[0]
        step = max(16, SLICE_BYTES // (4 * x.shape[-1]))
        flat = _rows(x)
        y = torch.empty(rows, n, dtype=torch.float32)
        for n0 in range(0, n, step):
            y[:, n0 : n0 + step] = F.linear(flat, torch.ops.llama_cpu.gguf_unpack(weight[n0 : n0 + step], qtype))
        return y.view(*x.shape[:-1], n).to(x.dtype)
    y = row_op(_rows(x), weight, qtype)
    return y.view(*x.shape[:-1], -1).to(x.dtype)


# Past this many rows of a prompt, gguf_linear_float multiplies unpacked fp32 slices in a GEMM (MKL's sgemm), faster
# than our row kernel there.
GGUF_FLOAT_MAX_ROWS = 16


def gguf_repack(weight: torch.Tensor, qtype: int = 12, back: bool = False) -> torch.Tensor:
    """A Q4_K matrix (N, row bytes) as a new tensor in the Q4_K_X8 layout (8 rows' blocks side by side, the same
    size: csrc/gguf_x8.h), whose products (qtype Q4_K_X8) equal the file layout's bit for bit; back: the file's
    layout again, byte for byte."""
    return torch.ops.llama_cpu.gguf_repack(weight, qtype, back)


def gguf_rows(weight: torch.Tensor, ids: torch.Tensor, qtype: int) -> torch.Tensor:
    """Rows `ids` of a GGUF-block matrix, dequantized to fp32, shaped (*ids.shape, K): an embedding lookup."""
    out = torch.ops.llama_cpu.gguf_rows(weight, ids.reshape(-1), qtype)
    return out.view(*ids.shape, -1)


def float_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W.T for a bf16 or fp32 weight, summed in fp32; result in x's dtype. bf16 activations with bf16 weights go
    in as they are (AVX-512 BF16 dot products where the CPU has them); others in fp32."""
    both_bf16 = x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    rows = x.reshape(-1, x.shape[-1]).contiguous() if both_bf16 else _rows(x)
    y = torch.ops.llama_cpu.float_linear(rows, weight)
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def _float_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16)


def _eager_float(t: torch.Tensor) -> bool:
    """The condition the attention and norm ops share: an fp32 or bf16 CPU tensor, outside torch.compile, kernels
    built."""
    return _float_cpu(t) and not torch.compiler.is_compiling() and available()


def norms(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm can run: x and a contiguous weight of one dtype (fp32 or bf16), eager on CPU."""
    return x.dtype == weight.dtype and weight.is_contiguous() and _eager_float(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model.RMSNorm in one call: rows normalised in fp32, rounded to x's dtype, scaled by weight."""
    return torch.ops.llama_cpu.rms_norm(x.contiguous(), weight, eps)


def attends(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether decode_attention can run this step: activations in the cache's dtype (fp32 or bf16), head_dim a
    multiple of 8, eager on CPU."""
    return x.dtype == cache.dtype and cache.shape[-1] % 8 == 0 and _eager_float(cache)


def decode_attention(q, k, v, cos, sin, cache_k, cache_v, rows, positions, kv_len: int,
                     table: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                     window: Optional[int] = None) -> torch.Tensor:
    """One token per row: rotate q and k (B, heads * head_dim), write k and v into the cache at `positions` (one per
    row, or one for all), attend over positions 0 .. position (at most kv_len) and return (B, heads * head_dim).
    rows: the cache rows (an int64 tensor), a slice of consecutive rows, or None for 0..B-1. table: a paged pool's
    block table (rows, blocks per row), the caches then (blocks, kv_heads, block_size, head_dim); read in place.
    scale: the scores' scale (None: head_dim ** -0.5); window: only the newest `window` positions (None: all)."""
    cos, sin, rows, row0, positions = attention_inputs(cos, sin, rows, positions)
    return torch.ops.llama_cpu.decode_attention(q, k, v, cos, sin, cache_k, cache_v, table, rows, row0, positions,
                                                kv_len, 0.0 if scale is None else float(scale), window or 0)


def attention_inputs(cos, sin, rows, positions):
    """The model's rotary rows, cache rows and positions as the ops take them: (cos, sin, rows, row0, positions),
    cos/sin (P, head_dim / 2), rows an int64 tensor or None with row0 the first of consecutive rows."""
    half = cos.shape[-1]
    row0 = 0
    if isinstance(rows, slice):
        row0, rows = rows.start or 0, None
    elif rows is not None:
        rows = rows.to(torch.int64).contiguous()
    return cos.reshape(-1, half), sin.reshape(-1, half), rows, row0, positions.reshape(-1).to(torch.int64)


def takes_float(weight: torch.Tensor) -> bool:
    """Whether an unquantized CPU weight's products run in float_linear (bf16 always; fp32 up to
    dense.FP32_KERNEL_MAX_ROWS rows), eager or inside torch.compile, where the weight then stays out of the
    graph (llama/compilation/compiled_decode.py)."""
    return _float_cpu(weight) and weight.is_contiguous() and (_loaded if torch.compiler.is_compiling() else available())


def takes(inputs: int) -> bool:
    """Whether a CPU layer with this input size can go to the quantized kernels (a multiple of the block), built."""
    return inputs % BLOCK == 0 and available()
