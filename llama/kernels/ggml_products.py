"""llama.cpp's batched K-quant products, for a model in llama.cpp's arithmetic (llama/kernels/ggml_arith.py).

Why: our block products sum every row as llama.cpp's one-token product does, and are row-invariant. llama.cpp's CPU
backend (an x86 build with AVX-512, as llama-cpp-python 0.3.36 builds it) multiplies a batch of tokens otherwise:
- Q4_K weights whose output rows are a multiple of 8 it repacks at load (q4_K_8x8); a batch of T >= 4 tokens goes
  through its gemm 4 rows at a time for the first T - T % 4 rows (activations quantized 4 rows at a time), the rest
  through its gemv, which our one-row product equals;
- Q3_K, Q4_K (not repacked), Q5_K, Q6_K and IQ4_XS weights go through its tiled kernel (ggml-cpu/tiled) from T >= 8;
- below those counts, its one-token dot, which our products equal.
Each sums in its own order (csrc/ggml_tiled.cpp says which), so a prompt fed in one batch gives other logits unless
the product follows the kernel llama.cpp picks for that many tokens. `install(model)` wraps the methods of the
model's GGUF-block layers so that their products do; the model's forward says each row's tokens (row_tokens).

T is the tokens per sequence in the pass (x's second-to-last dimension), as llama.cpp's is its ubatch's token
count: one prompt fed in one pass equals llama.cpp's prompt fed in one batch of n_ubatch or more (its default 512),
with every position's logits computed (llama.cpp's last layer multiplies only the rows it outputs, so with
logits_all=False its last FFN and output see 1 row). Q2_K, which llama.cpp repacks on AVX-512 (q2_K_8x8), keeps
our product. With row-invariant arithmetic on (prefix_cache="exact") every product is the one-token one, as the
attention is (llama.cpp fed one token at a time).
"""

from contextlib import contextmanager
from typing import List, Optional

import torch

from llama.kernels import cpu
from llama.kernels import invariant

Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS = 11, 12, 13, 14, 23
TILED = {Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS}  # llama.cpp's tiled kernel takes these from 8 tokens (Q2_K too, unrepacked)
TILED_FROM, X4_FROM = 8, 4


def kernel(qtype: int, out_rows: int, tokens: int) -> str:
    """Which product llama.cpp's CPU backend runs for a weight of ggml type qtype with out_rows output rows, on a
    batch of `tokens` tokens: "x4" (repacked Q4_K's 4-row gemm), "tiled", or "one" (its one-token dot: ours)."""
    if qtype == Q4_K and out_rows % 8 == 0:
        return "x4" if tokens >= X4_FROM else "one"
    return "tiled" if qtype in TILED and tokens >= TILED_FROM else "one"


def product(method, layer, x: torch.Tensor) -> torch.Tensor:
    """layer's product with x (..., T, K) as llama.cpp multiplies each sequence's T tokens, or its own count of
    tokens where the pass says it (sequence_tokens: the rest of its row is padding) (method: its GGUFBlocks)."""
    T = x.shape[-2] if x.dim() >= 2 else 1
    w = layer.weight
    if invariant.active() or w.device.type != "cpu":
        return cpu.gguf_linear(x, w, method.layout)
    rows = x.reshape(-1, T, x.shape[-1]).to(torch.float32)
    counts = _counts if _counts is not None and len(_counts) == rows.shape[0] else [T] * rows.shape[0]
    hows = [kernel(method.qtype, w.shape[0], min(c, T)) for c in counts]
    if all(h == "one" for h in hows):
        return cpu.gguf_linear(x, w, method.layout)
    if len(set(counts)) == 1 or all(h == "tiled" for h in hows):  # one call for the whole batch
        y = _rows(method, w, rows, hows[0], min(counts[0], T))
    else:
        y = torch.cat([_rows(method, w, rows[b : b + 1], h, min(c, T)) for b, (h, c) in enumerate(zip(hows, counts))])
    return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def _rows(method, w, rows: torch.Tensor, how: str, count: int) -> torch.Tensor:
    """rows (B, T, K) fp32 times w by kernel `how` for sequences of `count` tokens: (B, T, N)."""
    B, T, K = rows.shape
    if how == "one":
        return cpu.gguf_linear(rows, w, method.layout)
    if how == "tiled":
        return torch.ops.llama_ggml_mm.tiled(rows.reshape(-1, K).contiguous(), w, method.layout).view(B, T, -1)
    full = count - count % 4  # the gemm's rows; the rest go through the gemv, which our one-row product equals
    y = torch.ops.llama_ggml_mm.q4k_x4(rows[:, :full].reshape(-1, K).contiguous(), w, method.layout)
    y = y.view(B, full, -1)
    return torch.cat([y, cpu.gguf_linear(rows[:, full:], w, method.layout)], dim=1) if full < T else y


_counts = None  # tokens per sequence of the pass in progress, where it says them (sequence_tokens)


@contextmanager
def sequence_tokens(counts):
    """Within: the pass's rows hold counts[b] tokens each (padded to its width), which decide their products."""
    global _counts
    old, _counts = _counts, None if counts is None else [int(c) for c in counts]
    try:
        yield
    finally:
        _counts = old


def _class(base: type) -> type:
    """base (a GGUFBlocks method class) whose apply follows llama.cpp's batched products."""
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {"apply": lambda self, layer, x: product(self, layer, x),
                                            "ggml_products": True})
        _classes[base] = cls
    return cls


_classes: dict = {}


def row_tokens(logit_index) -> Optional[List[int]]:
    """The tokens of each row of a pass where its logit_index says them (each row's last token), for
    sequence_tokens(): a model in llama.cpp's arithmetic (Transformer.forward) passes them, so a prompt padded beside
    a longer one is multiplied as alone; None where the pass does not say."""
    return None if logit_index is None else (logit_index.reshape(-1) + 1).tolist()


def install(model) -> int:
    """Give every GGUF-block layer of model whose type llama.cpp multiplies otherwise in a batch llama.cpp's batched
    products (a method of its own class with that apply; llama/quantization/gguf_blocks.py's GGUFBlocks, known here
    by its qtype and layout, as kernels sit below quantization); returns how many layers. The model's forward
    passes each row's tokens (row_tokens) once it computes in llama.cpp's arithmetic (Transformer.use_ggml_arith)."""
    n = 0
    for layer in model.modules():
        m = getattr(layer, "method", None)
        if getattr(m, "quantized", False) and getattr(m, "qtype", None) in TILED and hasattr(m, "layout") \
                and not getattr(m, "ggml_products", False):
            layer.method = _class(type(m))()
            n += 1
    return n
