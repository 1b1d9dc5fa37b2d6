"""Row-invariant arithmetic, for prefix_cache="exact" (llama/core/scheduling/paging.py): while it is on, every row of a forward
pass is computed by the same operations whatever else the pass holds, so a position's keys, values and logits do
not depend on the pass's length, its KV length, how a prompt was chunked, or which requests share the batch.

The field's recipe (batch-invariant kernels: Thinking Machines' batch_invariant_ops, vLLM's and SGLang's
deterministic modes) is to fix each kernel's reduction order instead of letting it depend on the problem's shape.
What varies with the shape on our CPU path, and what takes its place while this is on (measured in
tests/core/worker/test_exact_invariance.py, cost in docs/performance.md):
- products: oneDNN's bf16 GEMM gives a row other bits at another M (rows 1-2 differ between 32 and 38 rows at K=2048), and
  bf16 under 17 rows or fp32 under 9 rows go to our kernel instead. oneDNN at one fixed M gives each row the same
  bits, so products of large weights run in tiles of a fixed row count (llama/kernels/tiled.py); our float_linear
  sums each row in one fixed order at any M and takes the rest. The same for int8-dynamic and int4 (our kernels, which a prefill past
  32 rows otherwise hands to oneDNN's bf16 GEMM: cpu.onednn_rows) and for the dequantized product of an "int8"
  layer too narrow for aten's packed kernel (which, like our GGUF block kernels, is row-invariant already).
- an int8 KV pool: attention through our decode kernel over its blocks dequantized (llama/kernels/exact_attention.py).
- attention: SDPA's reduction over keys depends on the pass's KV length. Our decode kernel attends each query row
  over positions 0..its own, in order, reading the paged blocks in place; a prefill's tokens go through it as rows
  (llama/kernels/paged.py flat_rows).
- SiLU: PyTorch's vectorized exp and its scalar tail differ in the last bit, and which elements fall in the tail
  depends on the tensor's size; silu() below computes one row at a time.
- the one-call decode step (fused_decode) computes SiLU over its whole batch, so it runs batches of one only.
The state is per thread (a ContextVar): the KV cache turns it on for its runner's passes (KVCache.manage).
"""

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

_ON: ContextVar = ContextVar("llama_row_invariant", default=False)
_LOGITS: ContextVar = ContextVar("llama_logits_product", default=False)


def active() -> bool:
    """Whether row-invariant arithmetic is on. Never inside a compiled step: "exact" decodes eagerly, and Dynamo
    cannot trace a ContextVar (the model calls this from its forward)."""
    return not torch.compiler.is_compiling() and _ON.get()


@contextmanager
def rows(on: bool = True):
    """Row-invariant arithmetic in this thread while the block runs (on=False: as it was)."""
    token = _ON.set(bool(on) or _ON.get())
    try:
        yield
    finally:
        _ON.reset(token)


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu; while active, one row at a time, so every row is computed as a lone row is (which of its elements
    fall in the vectorized loop's scalar tail depends only on the row's length): as the one-call decode step
    computes a batch of one."""
    if not active() or x.device.type != "cpu" or x.numel() == 0:
        return F.silu(x)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        return F.silu(x)
    out = torch.empty(rows.shape, dtype=x.dtype)
    for i in range(rows.shape[0]):
        torch.ops.aten.silu.out(rows[i], out=out[i])
    return out.view(x.shape)


def one_call_decodes(rows: int) -> bool:
    """Whether the one-call decode step (llama/kernels/fused_decode.py) may run `rows` rows: always, but while
    active only one (its SiLU runs over the whole batch at once)."""
    return rows == 1 or not active()


def logits(output, h: torch.Tensor) -> torch.Tensor:
    """output(h), the model's logits product: while active, marked as one of few rows (a pass's last positions, a
    decode batch), which our kernel takes at any row count faster than a GEMM tile (llama/kernels/tiled.py)."""
    if not active():
        return output(h)
    token = _LOGITS.set(True)
    try:
        return output(h)
    finally:
        _LOGITS.reset(token)


def in_logits() -> bool:
    return _LOGITS.get()
