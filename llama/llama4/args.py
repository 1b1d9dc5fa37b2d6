"""llama-models' `llama_models.llama4.args` names, for code written against it: `ModelArgs(**params,
max_seq_len=.., max_batch_size=..)` takes Meta's Llama 4 params.json as llama-models' pydantic model does (its
fields and defaults; nested moe_args, vision_args, quantization_args and lora_args as dicts or as these classes;
keys it has no field for are ignored, here with a warning), checked with a ValueError or TypeError naming the field.
Plain dataclasses: pydantic is not a dependency of this package.

`ModelArgs.to_model_args()` is this package's llama.model_args.ModelArgs of them, by the Meta-checkpoint loader's own
conversion (llama/formats/llama4.py meta_params). What that model cannot compute is refused there: the image
encoder (vision_args is skipped with a warning), Meta's quantized weights (quantization_args), LoRA adapters
(lora_args), a Llama 4 without experts (moe_args None)."""

import math
import warnings
from dataclasses import MISSING, dataclass, fields
from enum import Enum
from typing import Optional

from llama.formats import llama4
from llama.model_args import ModelArgs as LlamaModelArgs


class QuantizationScheme(Enum):
    int4_weight_int8_dynamic_activation = "int4_weight_int8_dynamic_activation"


def _check(owner: str, name: str, value, kind: str) -> None:
    """TypeError naming owner.name unless value is of kind: "int" (not a bool), "float" (an int or float, finite),
    "bool"; None passes (the optional fields)."""
    if value is None:
        return
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
          "bool": isinstance(value, bool)}[kind]
    if not ok:
        what = {"int": "an integer", "float": "a finite number", "bool": "true or false"}[kind]
        raise TypeError(f"{owner}.{name} must be {what}, got {value!r}")


def _typed(obj, kinds: dict) -> None:
    for name, kind in kinds.items():
        _check(type(obj).__name__, name, getattr(obj, name), kind)


def _nested(owner: str, name: str, value, cls):
    """A nested argument from itself, None or a dict (unknown keys: ValueError naming them and the known ones)."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{owner}.{name} must be a dict or a {cls.__name__}, got {type(value).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{owner}.{name} has unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")
    missing = [f.name for f in fields(cls) if f.name not in value and f.default is MISSING]
    if missing:
        raise ValueError(f"{owner}.{name} lacks {', '.join(missing)}")
    return cls(**value)


@dataclass
class QuantizationArgs:
    scheme: Optional[QuantizationScheme] = None
    group_size: Optional[int] = None
    spinquant: bool = False

    def __post_init__(self):
        if self.scheme is not None and not isinstance(self.scheme, QuantizationScheme):
            try:
                self.scheme = QuantizationScheme(self.scheme)
            except ValueError:
                raise ValueError(f"QuantizationArgs.scheme must be one of {[s.value for s in QuantizationScheme]}, "
                                 f"got {self.scheme!r}") from None
        _typed(self, {"group_size": "int", "spinquant": "bool"})


@dataclass
class LoRAArgs:
    rank: int
    scale: float

    def __post_init__(self):
        _typed(self, {"rank": "int", "scale": "float"})


@dataclass
class MoEArgs:
    num_experts: int = -1
    capacity_factor: float = 1.0
    auto_scale_F: bool = True  # noqa: N815 (Meta's name): the experts' hidden size is divided by capacity_factor + 1
    top_k: int = 1
    interleave_moe_layer_step: int = 1

    def __post_init__(self):
        _typed(self, {"num_experts": "int", "capacity_factor": "float", "auto_scale_F": "bool", "top_k": "int",
                      "interleave_moe_layer_step": "int"})


@dataclass
class Size:
    height: int
    width: int

    def __post_init__(self):
        _typed(self, {"height": "int", "width": "int"})


@dataclass
class VisionArgs:
    """Meta's image encoder's shape: accepted so its params.json reads, but the encoder is not implemented."""

    image_size: Size
    patch_size: Size
    dim: int
    n_layers: int
    n_heads: int
    mlp_ratio: float
    output_dim: int
    pixel_shuffle_ratio: float

    def __post_init__(self):
        self.image_size = _nested("VisionArgs", "image_size", self.image_size, Size)
        self.patch_size = _nested("VisionArgs", "patch_size", self.patch_size, Size)
        _typed(self, {"dim": "int", "n_layers": "int", "n_heads": "int", "mlp_ratio": "float", "output_dim": "int",
                      "pixel_shuffle_ratio": "float"})


_KINDS = {"dim": "int", "n_layers": "int", "n_heads": "int", "n_kv_heads": "int", "head_dim": "int",
          "vocab_size": "int", "multiple_of": "int", "ffn_dim_multiplier": "float", "ffn_exp": "float",
          "norm_eps": "float", "attention_chunk_size": "int", "rope_theta": "float", "use_scaled_rope": "bool",
          "rope_scaling_factor": "float", "rope_high_freq_factor": "float", "nope_layer_interval": "int",
          "use_qk_norm": "bool", "attn_temperature_tuning": "bool", "floor_scale": "float", "attn_scale": "float",
          "max_batch_size": "int", "max_seq_len": "int"}


@dataclass
class _Fields:
    dim: int = -1
    n_layers: int = -1
    n_heads: int = -1
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    vocab_size: int = -1  # -1: the tokenizer's (Llama4.build sets it)
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    ffn_exp: Optional[float] = None
    norm_eps: float = 1e-5
    attention_chunk_size: Optional[int] = None
    rope_theta: float = 500000
    use_scaled_rope: bool = False
    rope_scaling_factor: Optional[float] = None
    rope_high_freq_factor: Optional[float] = None
    nope_layer_interval: Optional[int] = None
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    vision_args: Optional[VisionArgs] = None
    moe_args: Optional[MoEArgs] = None
    quantization_args: Optional[QuantizationArgs] = None
    lora_args: Optional[LoRAArgs] = None
    max_batch_size: int = 32
    max_seq_len: int = 2048

    def __post_init__(self):
        """ModelArgs checks them."""


class ModelArgs(_Fields):
    """Meta's Llama 4 ModelArgs: keyword arguments only, as pydantic's model takes them."""

    def __init__(self, **values):
        known = {f.name for f in fields(_Fields)}
        unknown = sorted(set(values) - known)
        if unknown:
            warnings.warn(f"ModelArgs: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a field of "
                          "Meta's Llama 4 ModelArgs; ignored (as llama-models ignores it)", stacklevel=2)
        super().__init__(**{k: v for k, v in values.items() if k in known})

    def __post_init__(self):
        for name, cls in (("vision_args", VisionArgs), ("moe_args", MoEArgs), ("quantization_args", QuantizationArgs),
                          ("lora_args", LoRAArgs)):
            setattr(self, name, _nested("ModelArgs", name, getattr(self, name), cls))
        _typed(self, _KINDS)
        for name in ("dim", "n_layers", "n_heads", "max_batch_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelArgs.{name} must be a positive integer, got {getattr(self, name)}")
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if not 1 <= kv <= self.n_heads or self.n_heads % kv:
            raise ValueError(f"ModelArgs.n_kv_heads ({kv}) must divide n_heads ({self.n_heads})")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelArgs.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.use_scaled_rope:  # Meta's: only Scout scales its rope, and its params.json leaves these out
            if self.rope_scaling_factor is None:
                self.rope_scaling_factor = 16
            if self.rope_high_freq_factor is None:
                self.rope_high_freq_factor = 1

    def params(self) -> dict:
        """The params.json dict of these arguments (None fields left out, nested arguments as dicts)."""
        out = {}
        for f in fields(_Fields):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = params_of(value)
        return out

    def to_model_args(self) -> LlamaModelArgs:
        """This package's ModelArgs of these, as the Meta-checkpoint loader converts a Llama 4 params.json (a
        vision_args warns that the image encoder is skipped)."""
        if self.moe_args is None:
            raise ValueError("ModelArgs.moe_args is None: the Llama 4 text model here has experts (Scout's or "
                             "Maverick's moe_args)")
        if self.quantization_args is not None:
            raise ValueError("ModelArgs.quantization_args: Meta's quantized Llama 4 weights are not read here; load "
                             "the bf16 checkpoint (Llama4.build / Llama.build take quantize= for our own schemes)")
        if self.lora_args is not None:
            raise ValueError("ModelArgs.lora_args: LoRA adapters are not merged here")
        return LlamaModelArgs(**llama4.meta_params(self.params(), "ModelArgs"))


def params_of(value):
    if isinstance(value, Enum):
        return value.value
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: params_of(getattr(value, f.name)) for f in fields(value)}
    return value
