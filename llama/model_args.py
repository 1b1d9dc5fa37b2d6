"""The model's hyperparameters (Meta's params.json, plus what the LLaMA-style families change), checked once when
built: every field the transformer, the loaders and the kernels read. `llama.model.ModelArgs` is Meta's path to it."""

import json
import math
import warnings
from dataclasses import dataclass, fields
from typing import Optional, Tuple

import torch

from llama import rope
from llama.sizes import ffn_hidden_dim

ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    """A mixture-of-experts FFN (Mixtral, Qwen3-MoE, Llama 4): which layers have one, its experts, and how a token
    picks them.

    Layer i is an MoE layer when (i + 1) % every == 0 and i is not in dense_layers (Qwen3-MoE's decoder_sparse_step
    and mlp_only_layers); the others keep the dense FFN of ModelArgs.hidden_dim."""

    n_experts: int
    top_k: int
    hidden_dim: int  # each expert's SwiGLU hidden size
    renormalize: bool = True  # the top-k weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    router: str = "softmax"  # softmax over every expert's logit, then the top k; "sigmoid": the top k logits' sigmoids
    every: int = 1
    dense_layers: Tuple[int, ...] = ()
    scale_inputs: bool = False  # a routed expert's input is scaled by its weight, not its output (Llama 4)
    shared_expert: bool = False  # one more expert of hidden_dim that every token goes through, added (Llama 4)

    def __post_init__(self):
        for name in ("n_experts", "top_k", "hidden_dim", "every"):
            positive("MoE argument", name, getattr(self, name))
        if self.top_k > self.n_experts:
            raise ValueError(f"MoE top_k ({self.top_k}) must be at most n_experts ({self.n_experts})")
        for name in ("renormalize", "scale_inputs", "shared_expert"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoE {name} must be true or false, got {getattr(self, name)!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"MoE router {self.router!r} is not supported (supported: {', '.join(ROUTERS)})")
        layers = self.dense_layers
        if not isinstance(layers, (tuple, list)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                            and i >= 0 for i in layers):
            raise ValueError(f"MoE dense_layers must be a list of layer indices, got {layers!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(layers))))

    def is_moe(self, layer_id: int) -> bool:
        return (layer_id + 1) % self.every == 0 and layer_id not in self.dense_layers

    @classmethod
    def of(cls, value) -> Optional["MoEArgs"]:
        """MoEArgs from itself, None, or a params.json-style dict (ValueError naming unknown keys)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"moe must be a dict of MoE arguments, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"moe has unknown keys {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        try:
            return cls(**value)
        except TypeError as e:
            raise ValueError(f"moe: {e}") from None


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = -1  # -1: take the tokenizer's
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1's rotary frequency scaling ("use_scaled_rope" in params.json). Meta's 3.2 1B/3B params.json cannot
    # say their factor is 32 (Meta's own code applies 8): pass rope_scaling_factor to Llama.build for those.
    use_scaled_rope: bool = False
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    max_batch_size: int = 32
    max_seq_len: int = 2048
    # What the LLaMA-style families change (llama/formats/architectures.py reads them from their files); the
    # defaults are Meta's architecture. Shapes are explicit where a family breaks the params.json conventions.
    head_dim: Optional[int] = None  # None: dim // n_heads
    hidden_dim: Optional[int] = None  # SwiGLU hidden size; None: the rule of multiple_of and ffn_dim_multiplier
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    sliding_window: Optional[int] = None  # each query sees this many newest keys, itself included (Mistral v0.1)
    rope_scaling: Optional[dict] = None  # linear, YaRN or long-rope (llama/rope.py); Llama 3.1's is use_scaled_rope
    embedding_multiplier: float = 1.0  # Granite's multipliers: of the embeddings,
    residual_multiplier: float = 1.0  # of each block's attention and FFN outputs before the residual add,
    attention_multiplier: Optional[float] = None  # the attention scale (None: head_dim ** -0.5),
    logits_scaling: float = 1.0  # and the divisor of the logits
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before the rotation (Qwen3)
    moe: Optional[MoEArgs] = None  # mixture-of-experts FFNs (llama/moe.py); a dict in params.json
    # Llama 4's iRoPE (llama/model.py IRoPEAttention, llama/rope.py): layers n, 2n, .. (1-based) of nope_layer_interval have no rotation and attend
    # globally; the others attend within chunks of attention_chunk_size positions, their q and k L2-normalised after
    # the rotation (qk_l2_norm: Meta's use_qk_norm, no weight); attn_temperature_tuning scales a NoPE layer's queries
    # by log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1 at position p.
    attention_chunk_size: Optional[int] = None
    nope_layer_interval: Optional[int] = None
    qk_l2_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self.moe = MoEArgs.of(self.moe)
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "max_batch_size", "max_seq_len"):
            positive("model argument", name, getattr(self, name))
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
            self.head_dim = self.dim // self.n_heads
        if self.hidden_dim is None:
            self.hidden_dim = ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)
        for name in ("head_dim", "hidden_dim"):
            positive("model argument", name, getattr(self, name))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head dimension {self.head_dim} must be even for rotary embeddings")
        self.check_rope()
        self.check_family()

    def check_family(self) -> None:
        """ValueError naming the field for a family setting out of range."""
        for name in ("qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.sliding_window is not None:
            positive("model argument", "sliding_window", self.sliding_window)
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is None and name == "attention_multiplier":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        rope.check(self.rope_scaling, self.head_dim)
        if self.rope_scaling is not None and self.use_scaled_rope:
            raise ValueError("use_scaled_rope (Llama 3.1's scaling) and rope_scaling cannot both be set")
        self.check_irope()

    def check_irope(self) -> None:
        """ValueError naming the field for Llama 4's attention settings out of range."""
        for name in ("attention_chunk_size", "nope_layer_interval"):
            if getattr(self, name) is not None:
                positive("model argument", name, getattr(self, name))
        for name in ("qk_l2_norm", "attn_temperature_tuning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("floor_scale", "attn_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.irope and (self.sliding_window is not None or self.attention_multiplier is not None):
            raise ValueError("Llama 4's attention (attention_chunk_size, nope_layer_interval, qk_l2_norm, "
                             "attn_temperature_tuning) cannot be combined with sliding_window or attention_multiplier")

    @property
    def irope(self) -> bool:
        """Whether the layers attend as Llama 4's do (llama/model.py IRoPEAttention): chunks, NoPE layers, L2 qk-norm, temperature."""
        return (self.attention_chunk_size is not None or self.nope_layer_interval is not None or self.qk_l2_norm
                or self.attn_temperature_tuning)

    def is_nope(self, layer_id: int) -> bool:
        """Whether layer layer_id has no rotary embedding (a global-attention layer of Llama 4's iRoPE)."""
        return self.nope_layer_interval is not None and (layer_id + 1) % self.nope_layer_interval == 0

    def check_rope(self) -> None:
        """ValueError naming the field for rotary settings that would silently give NaN or unscaled tables."""
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
        if not number(self.rope_theta) or self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        if not isinstance(self.use_scaled_rope, bool):
            raise ValueError(f"use_scaled_rope must be true or false, got {self.use_scaled_rope!r}")
        if not self.use_scaled_rope:
            return
        low, high, ctx = self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_context
        if not number(self.rope_scaling_factor) or self.rope_scaling_factor < 1:
            raise ValueError(f"rope_scaling_factor must be a number >= 1, got {self.rope_scaling_factor!r}")
        if not (number(low) and number(high) and 0 < low < high):
            raise ValueError(f"rope_low_freq_factor ({low!r}) and rope_high_freq_factor ({high!r}) must be numbers "
                             "with 0 < low < high")
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
            raise ValueError(f"rope_original_context must be a positive integer, got {ctx!r}")

    def kernel_attends(self, kv_len: int) -> bool:
        """Whether our one-token CPU attention (causal over every key, scale head_dim ** -0.5) is this
        architecture's over kv_len keys: no other scale, no window that kv_len passes, not Llama 4's layers."""
        return self.attention_multiplier is None and (self.sliding_window is None or kv_len <= self.sliding_window) \
            and not self.irope

    def kernel_decodes(self, kv_len: int) -> bool:
        """Whether the one-call fused step (llama/kernels/fused_decode.py) computes these layers: our attention,
        no biases, no residual multiplier (qk-norm and experts it takes). Otherwise the layers run one by one, with our
        product kernels."""
        return self.kernel_attends(kv_len) and not self.qkv_bias and self.residual_multiplier == 1

    def mask_window(self, mask: torch.Tensor, key_pos: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The causal mask with the sliding window's term: a query at p sees keys p - window + 1 .. p."""
        if self.sliding_window is None:
            return mask
        return mask & (key_pos > positions - self.sliding_window)

    @classmethod
    def from_params(cls, params: dict, **overrides) -> "ModelArgs":
        """Build from a params.json dict; keys this architecture does not use are ignored with a warning."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            warnings.warn(f"params.json keys {', '.join(unknown)} are not used by this architecture; ignored",
                          stacklevel=2)
        kwargs = {k: v for k, v in params.items() if k in known}
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path, **overrides) -> "ModelArgs":
        with open(path) as f:
            return cls.from_params(json.load(f), **overrides)


def positive(what: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} {name} must be a positive integer, got {value!r}")


def check_model_parallel(args: ModelArgs, mp: int) -> None:
    """Raise ValueError unless every split dimension divides evenly across mp ranks (each expert is split like a
    dense FFN: tensor parallel, the router on every rank)."""
    split = [("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), ("dim", args.dim),
             ("FFN hidden dim", args.hidden_dim), ("vocab_size", args.vocab_size)]
    if args.moe is not None:
        split.append(("expert hidden dim", args.moe.hidden_dim))
    for name, value in split:
        if value % mp:
            raise ValueError(f"model parallel size {mp} does not divide {name} ({value}): use a size that does")
