"""The reference's SwiGLU sizing rule, and its inverse: which (multiple_of, ffn_dim_multiplier) give a checkpoint's
FFN width, so params.json written from a GGUF or Hugging Face config reproduces it."""

from typing import Optional, Tuple


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float] = None,
                   hidden_dim: Optional[int] = None) -> int:
    """The reference's SwiGLU sizing rule: 2/3 of hidden_dim (4*dim), scaled, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim if hidden_dim is None else hidden_dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


_MULTIPLES = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1)


def derive_ffn(dim: int, hidden_dim: int) -> Tuple[int, Optional[float]]:
    """(multiple_of, ffn_dim_multiplier) whose ffn_hidden_dim(dim, ...) is exactly hidden_dim.

    Prefers no multiplier and the largest multiple_of (stories260K: 4; Llama 2 7B: 256), then round multipliers
    (Llama 2 70B: 1.3 with 4096).
    """
    if dim < 1 or hidden_dim < 1:
        raise ValueError(f"dim ({dim}) and FFN hidden dim ({hidden_dim}) must be positive")
    for m in _MULTIPLES:
        if ffn_hidden_dim(dim, m) == hidden_dim:
            return m, None
    base = int(2 * (4 * dim) / 3)
    ratio = hidden_dim / base
    candidates = [round(ratio, k) for k in range(1, 7)] + [ratio, (hidden_dim + 0.5) / base]
    for mult in dict.fromkeys(candidates):  # ordered, without repeats
        for m in _MULTIPLES:
            if mult > 0 and ffn_hidden_dim(dim, m, mult) == hidden_dim:
                return m, mult
    raise ValueError(f"no multiple_of/ffn_dim_multiplier reproduces FFN hidden dim {hidden_dim} for dim {dim}")
