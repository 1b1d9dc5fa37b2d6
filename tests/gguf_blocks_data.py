"""Random valid GGUF blocks of every block format (gguf 0.19 cannot quantize to K- or i-quants, so tests build the
bytes): random bytes are valid blocks once their fp16 scales are finite and small."""

import numpy as np
import torch

# ggml type name -> byte offsets of the block's fp16 fields (scales, and mins where the format has them)
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,)}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, row bytes) uint8: rows of `cols` values of GGUF type `kind`, random but valid."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for offset in HALF_FIELDS[kind]:
        half = rng.uniform(0.002, 0.02, size=(rows, cols // values)).astype(np.float16)
        if offset == 0 and kind not in ("Q4_K", "Q5_K", "Q2_K"):
            half *= rng.choice(np.array([-1, 1], dtype=np.float16), size=half.shape)
        data[:, :, offset : offset + 2] = half.view(np.uint8).reshape(rows, -1, 2)
    return data.reshape(rows, -1)


def dequantized(blocks: np.ndarray, kind: str) -> torch.Tensor:
    """gguf's own numpy dequantization of these blocks, as fp32 (rows, cols)."""
    import gguf
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks, gguf.GGMLQuantizationType[kind])))


def act_block(kind: str) -> int:
    """The activation block our kernels quantize x in for weights of this type: llama.cpp's Q8_0 or Q8_K."""
    return 256 if kind.endswith("_K") or kind == "IQ4_XS" else 32


def quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (M, K) as our kernels see it: int8 codes per block (d = amax / 127, round half to even) times d, fp64."""
    xb = x.float().reshape(x.shape[0], -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    codes = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1.0)), torch.zeros_like(xb))
    return (codes.double() * d.double()).reshape(x.shape)
