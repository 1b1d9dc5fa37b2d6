"""Row-invariant arithmetic, for prefix_cache="exact" (llama/core/paging.py): while it is on, every row of a forward
pass is computed by the same operations whatever else the pass holds, so a position's keys, values and logits do
not depend on the pass's length, its KV length, how a prompt was chunked, or which requests share the batch.

The field's recipe (batch-invariant kernels: Thinking Machines' batch_invariant_ops, vLLM's and SGLang's
deterministic modes) is to fix each kernel's reduction order instead of letting it depend on the problem's shape.
What varies with the shape on our CPU path, and what takes its place while this is on (measured in
tests/core/test_exact_invariance.py, cost in docs/performance.md):
- products: oneDNN's bf16 GEMM blocks its K reduction by M (rows 1-2 differ between 32 and 38 rows at K=2048), and
  bf16 under 17 rows or fp32 under 9 rows go to our kernel instead. Our float_linear sums each row in one fixed
  order at any M, so it takes every product.
- attention: SDPA's reduction over keys depends on the pass's KV length. Our decode kernel attends each query row
  over positions 0..its own, in order, reading the paged blocks in place; a prefill's tokens go through it as rows
  (llama/kernels/paged.py flat_rows).
- SiLU: PyTorch's vectorized exp and its scalar tail differ in the last bit, and which elements fall in the tail
  depends on the tensor's size; silu() below computes every element by the scalar path.
- the one-call decode step (fused_decode) computes SiLU over the batch with PyTorch's vectorized op, so it is off.
The state is per thread (a ContextVar): the KV cache turns it on for its runner's passes (KVCache.manage).
"""

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

_ON: ContextVar = ContextVar("llama_row_invariant", default=False)


def active() -> bool:
    return _ON.get()


@contextmanager
def rows(on: bool = True):
    """Row-invariant arithmetic in this thread while the block runs (on=False: as it was)."""
    token = _ON.set(bool(on) or _ON.get())
    try:
        yield
    finally:
        _ON.reset(token)


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu; while active, every element by PyTorch's scalar path (a strided view is never vectorized), so an
    element's result does not depend on where it falls in the tensor."""
    if not _ON.get() or x.device.type != "cpu" or x.numel() == 0:
        return F.silu(x)
    wide = x.new_empty(*x.shape[:-1], 2 * x.shape[-1])
    view = wide[..., ::2]
    view.copy_(x)
    return F.silu(view)
