"""llama-models' `llama_models.llama4.model` names, for code written against it: `Transformer(args)` of Meta's
Llama 4 ModelArgs (llama.llama4.args) is this package's transformer (llama.model.Transformer, built from
args.to_model_args()), with Meta's call: `forward(TransformerInput(tokens (B, S), tokens_position))` returns
`TransformerOutput(logits=fp32 (B, S, vocab_size))`, the KV cache of rows 0..B-1 kept across calls as Meta's
(allocated at the first call, args.max_batch_size rows of args.max_seq_len positions, in the weights' dtype).
`load_state_dict` takes Meta's names (its model's state dict, or one consolidated shard at model-parallel size 1:
3-D experts, router_DE, fused wqkv ...) through the Meta-checkpoint loader's renaming (llama/formats/llama4.py);
state_dict() gives ours.

Differences: tokens_position may also be one start per row (a (B,) tensor; Meta's asserts an int); a one-token
step on a chunked layer attends within its chunk, as Meta's prefill and transformers do (Meta's decode step, having
no mask, attends past it); image_embedding is refused (no image encoder). RMSNorm, apply_rotary_emb and
reshape_for_broadcast are this package's (Meta's computation); precompute_freqs_cis has Meta's Llama 4 signature.
"""

from typing import Optional

import torch

from llama.core.worker.kv_cache import KVCache, model_kv_dtype
from llama.formats import llama4 as formats
from llama.formats.meta_checkpoint import DROPPED
from llama.llama4.args import ModelArgs
from llama.llama4.datatypes import TransformerInput, TransformerOutput
from llama.model import RMSNorm  # noqa: F401 (Meta's path)
from llama.model import Transformer as LlamaTransformer
from llama.rope import apply_rotary_emb, reshape_for_broadcast  # noqa: F401 (Meta's path)
from llama.rope import scale_rope_frequencies

__all__ = ["Transformer", "RMSNorm", "precompute_freqs_cis", "apply_rotary_emb", "reshape_for_broadcast"]


def precompute_freqs_cis(dim: int, end: int, theta: float, use_scaled: bool, scale_factor: Optional[float],
                         high_freq_factor: Optional[float]) -> torch.Tensor:
    """Meta's Llama 4 complex64 table (end, dim // 2): use_scaled divides the frequencies whose wavelength passes
    8192 positions by scale_factor (high_freq_factor sets where; low_freq_factor is 1)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    if use_scaled:
        freqs = scale_rope_frequencies(freqs, scale_factor, 1.0, high_freq_factor, 8192)
    angles = torch.outer(torch.arange(end, device=freqs.device, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


class Transformer(LlamaTransformer):
    """Meta's Llama 4 text transformer; called with anything but a TransformerInput it is llama.model.Transformer
    (forward(tokens, start_pos, ...)), so the runner and the KV cache of a Llama can use it too."""

    def __init__(self, args: ModelArgs, **kwargs):
        if not isinstance(args, ModelArgs):
            raise TypeError(f"args must be llama.llama4.args.ModelArgs (Meta's Llama 4 arguments), got "
                            f"{type(args).__name__}")
        super().__init__(args.to_model_args())
        self.args = args
        self.kv_cache: Optional[KVCache] = None

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Meta's names (or ours) loaded into ours; rope.freqs, which the model recomputes, is dropped."""
        state = {k: v for k, v in state_dict.items() if k not in DROPPED}
        return super().load_state_dict(formats.meta_shard(state, self.params, "state_dict"), strict=strict,
                                       assign=assign)

    def forward(self, model_input, *args, **kwargs):
        if not isinstance(model_input, TransformerInput):
            return super().forward(model_input, *args, **kwargs)
        if args or kwargs:
            raise TypeError("forward(TransformerInput) takes no other arguments")
        if model_input.image_embedding is not None:
            raise NotImplementedError(f"TransformerInput.image_embedding: {formats.VISION}")
        tokens, start = self.checked(model_input)
        self.ensure_cache(tokens.device)
        return TransformerOutput(logits=super().forward(tokens, start))

    def checked(self, model_input: TransformerInput):
        """(tokens, start) of a TransformerInput, ValueError/TypeError naming what is out of range."""
        tokens, start = model_input.tokens, model_input.tokens_position
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point() \
                or tokens.is_complex() or tokens.dtype == torch.bool:
            got = f"shape {tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else \
                type(tokens).__name__
            raise TypeError(f"TransformerInput.tokens must be an integer tensor (batch, seqlen), got {got}")
        B, S = tokens.shape
        if not 1 <= B <= self.args.max_batch_size or S < 1:
            raise ValueError(f"TransformerInput.tokens has shape {(B, S)}: the batch must be 1 to max_batch_size "
                             f"({self.args.max_batch_size}) rows of at least one token")
        if isinstance(start, torch.Tensor) and start.dim() == 0:
            start = int(start)
        if isinstance(start, torch.Tensor):
            if start.shape != (B,) or start.is_floating_point():
                raise ValueError(f"TransformerInput.tokens_position as a tensor must hold one integer start per row, "
                                 f"shape ({B},), got {tuple(start.shape)} {start.dtype}")
            first, last = int(start.min()), int(start.max())
        elif isinstance(start, int) and not isinstance(start, bool):
            first = last = start
        else:
            raise TypeError(f"TransformerInput.tokens_position must be an int or a (batch,) tensor, got "
                            f"{type(start).__name__}")
        if first < 0 or last + S > self.args.max_seq_len:
            raise ValueError(f"TransformerInput: positions {first}..{last + S - 1} must lie in 0..max_seq_len - 1 "
                             f"({self.args.max_seq_len - 1})")
        return tokens, start.to(tokens.device) if isinstance(start, torch.Tensor) else start

    def ensure_cache(self, device) -> None:
        """Allocate the KV cache (Meta's: max_batch_size x max_seq_len) unless one of the weights' dtype and device
        is there (a Llama's, or this model's own from an earlier call)."""
        cache_k = self.layers[0].attention.cache_k
        if cache_k is not None and cache_k.dtype == model_kv_dtype(self) and cache_k.device == self.norm.weight.device:
            return
        if self.norm.weight.device != device:
            raise ValueError(f"TransformerInput.tokens are on {device}, the model on {self.norm.weight.device}")
        self.kv_cache = KVCache(self, self.args.max_batch_size, self.args.max_seq_len)
