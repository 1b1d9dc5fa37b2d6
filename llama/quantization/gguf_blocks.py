"""Weights in GGUF's own block formats (Q8_0, Q4_K, Q6_K ... as llama.cpp's files hold them), multiplied in our CPU
kernels without dequantizing: a layer holds its (N, row bytes) uint8 blocks, memory-mapped from the file or sliced
from it, and its method knows their ggml type and the activations' arithmetic.

Why: a Q4_K_M file of a 7B model is 4 GB; dequantized it is 13.5 GB in bf16 and runs at bf16's speed. Kept as the
file's blocks, it is read at its own size, as llama.cpp reads it. Three arithmetics, chosen at load
(LLAMA_GGUF_ACTIVATIONS), by measured quality, then speed (docs/performance.md, "Quality of the default
arithmetic"):
- "int16" (the default): activations quantized to int16 in blocks of 32, times the weight codes widened to int16,
  summed exactly in int32 (csrc/gguf_x16.cpp): within 2^-16 of each activation block's largest value of the
  dequantized file's product, about 1.5x the fp32 path's speed on AVX2. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K and Q6_K;
  the other formats run "float".
- "float": each 32-value chunk of a weight row is decoded to fp32 in registers and multiplied by fp32 activations
  (csrc/gguf_float.cpp), the dequantized file's product to fp32 rounding.
- "int8": activations quantized to int8 blocks as llama.cpp does (Q8_0 for the 32-value formats, Q8_K for the
  super-block formats; csrc/gguf_blocks.cpp), llama.cpp's products bit for bit. It makes small models answer worse.
A prompt's pass of more than 16 rows multiplies its fp32 activations by unpacked fp32 weights in a GEMM under
"int16" too. Every way a row's result never depends on its batch.

Each type has its own method class, so fusing (llama/layers.py fuse_columns) only concatenates projections of one
type: a Q4_K_M file keeps its Q6_K projections apart from its Q4_K ones.
"""

from functools import lru_cache

import torch
from torch import nn

from llama import settings
from llama.kernels import cpu
from llama.kernels import fused_decode
from llama.layers import LinearMethod

# ggml type ids our kernels run (gguf.GGMLQuantizationType) -> their names
NAMES = {8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 20: "IQ4_NL", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
         23: "IQ4_XS", 10: "Q2_K", 11: "Q3_K"}


# each arithmetic's scheme in the one-call decode step (llama/kernels/fused_decode.py)
SCHEMES = {"int8": fused_decode.GGUF, "float": fused_decode.GGUF_FLOAT, "int16": fused_decode.GGUF_X16}


class GGUFBlocks(LinearMethod):
    """A weight as GGUF blocks of one ggml type (`qtype`), (N, row bytes) uint8 in layer.weight, laid out as the
    file has them or (`layout` other than qtype) repacked for our kernels (Q4_K's 8-row groups: repack())."""

    quantized = True
    qtype = -1
    layout = -1  # the id our kernels take: qtype, or cpu.Q4_K_X8
    activations = "int16"  # "int16" (gguf_linear_x16), "float" (gguf_linear_float) or "int8" (llama.cpp's blocks)
    # SmolLM2's Q4_1 decodes no faster compiled (0.98x eager, `python -m benchmarks compile-gguf`, docs/performance.md
    # "First run"), and compiling mid-run cost a newcomer minutes on a busy machine
    eager_decode = True

    def apply(self, layer, x):
        if self.activations == "int8":
            return cpu.gguf_linear(x, layer.weight, self.layout)
        if self.activations == "int16":
            return cpu.gguf_linear_x16(x, layer.weight, self.layout)
        return cpu.gguf_linear_float(x, layer.weight, self.layout)

    def route(self, layer, rows, dtype):
        if layer.weight.device.type != "cpu":
            return None
        scheme = SCHEMES[self.activations]
        return scheme, self.layout, (layer.weight,)

    def in_our_kernels(self, layer):
        return layer.weight.device.type == "cpu"

    def file_blocks(self, layer) -> torch.Tensor:
        """The weight's blocks as the file holds them (a copy where repacked)."""
        if self.layout == self.qtype:
            return layer.weight.data
        return cpu.gguf_repack(layer.weight.data, self.qtype, back=True)

    def __repr__(self) -> str:
        repacked = ", repacked" if self.layout != self.qtype else ""
        return f"GGUFBlocks({NAMES[self.qtype]}{repacked}, {self.activations} activations)"


@lru_cache(maxsize=None)
def method_class(qtype: int, layout: int = -1, activations: str = "int16") -> type:
    layout = qtype if layout < 0 else layout
    name = f"GGUFBlocks_{NAMES[qtype]}" + ("_x8" if layout != qtype else "") + f"_{activations}"
    # a repacked weight's rows are not the file's: it is neither concatenated nor cut into Meta's layers
    extra = {} if layout == qtype else {"concatenates": False, "splits_state": False}
    return type(name, (GGUFBlocks,), {"qtype": qtype, "layout": layout, "activations": activations, **extra})


def method(qtype: int, activations: str = "int16") -> GGUFBlocks:
    """The method for weights of ggml type qtype multiplied with `activations` ("int16", "float" or "int8"); one class per
    type and arithmetic, so only equal ones fuse."""
    if qtype not in NAMES:
        raise ValueError(f"ggml type {qtype} is not run natively (natively: {', '.join(NAMES.values())})")
    if activations not in settings.GGUF_ACTIVATIONS:
        raise ValueError(f"GGUF activations must be one of {settings.GGUF_ACTIVATIONS}, got {activations!r}")
    return method_class(qtype, -1, activations)()


# file type -> the layout our int8-activation kernels run it in faster (the fp32 unpack reads the file's layout)
REPACKS = {12: cpu.Q4_K_X8}


def repack(layer) -> bool:
    """Hold layer's Q4_K blocks in the Q4_K_X8 layout (8 rows' blocks side by side: llama/kernels/csrc/gguf_x8.h):
    a new tensor of the same size, so the mapped file pages it came from can be released. Products are the same
    bit for bit; a decode step's Q4_K products then take about 0.6x the CPU time (docs/performance.md).
    False where the layer is not file-layout Q4_K on CPU."""
    m = getattr(layer, "method", None)
    if not isinstance(m, GGUFBlocks) or m.layout != m.qtype or m.qtype not in REPACKS or m.activations != "int8":
        return False
    if layer.weight.device.type != "cpu":
        return False
    layer.take(method_class(m.qtype, REPACKS[m.qtype], m.activations)(),
               cpu.gguf_repack(layer.weight.data, m.qtype))
    return True


def values_per_row(qtype: int, row_bytes: int) -> int:
    return cpu.gguf_values(qtype, row_bytes)


class BlockEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks: a lookup dequantizes only the rows it reads (fp32; the model casts
    them). Every rank holds the whole table (it is the file's size, not a dequantized copy), so under model parallel
    the rows need no gather."""

    def __init__(self, blocks: torch.Tensor, qtype: int, mp: int = 1):
        super().__init__()
        self.weight = nn.Parameter(blocks, requires_grad=False)
        self.qtype, self.mp = qtype, mp
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = values_per_row(qtype, blocks.shape[1])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return cpu.gguf_rows(self.weight, tokens, self.qtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {NAMES[self.qtype]}"

