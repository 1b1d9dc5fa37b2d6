"""The parts of a generator's configuration, each a frozen dataclass that checks its own fields when it is built.

Llama.build, the CLIs and the server build one LlamaConfig (llama/config/resolve.py) from their arguments, as
vLLM's EngineArgs become a VllmConfig; every object then gets the part it needs when it is built. The choice lists
here are the ones the CLIs' flags offer.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from llama.quantization import registry
from llama.quantization.registry import QuantScheme
from llama.settings import parse_bytes

PREFIX_CACHE_MODES = ("on", "exact", "off")  # llama/core/scheduling/paging.py
SPECULATIVE_MODES = ("ngram", "draft")  # llama/core/speculation/speculative.py; "draft": a draft model drafts
KV_CACHE_DTYPES = ("int8",)  # besides the model's own (llama/core/worker/kv_cache.py)
CHECKPOINT_KINDS = ("meta", "hf", "gguf", "quantized", "memory")  # quantized: written by `python -m llama.quantize`;
# memory: a model already built (Meta's Llama(model, tokenizer))


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _set(obj, name: str, value) -> None:
    """A frozen dataclass normalizing one of its own fields while it is built (True -> "on")."""
    object.__setattr__(obj, name, value)


def prefix_cache_mode(mode) -> str:
    """prefix_cache as given (a mode, or a bool) -> one of PREFIX_CACHE_MODES."""
    if mode is True:
        return "on"
    if mode is False or mode is None:
        return "off"
    if mode not in PREFIX_CACHE_MODES:
        raise ValueError(f"prefix_cache must be True, False, 'on', 'exact' or 'off', got {mode!r}")
    return mode


def speculative_mode(mode) -> Optional[str]:
    """speculative as given -> None (off) or one of SPECULATIVE_MODES."""
    if mode in (None, False, "off"):
        return None
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative must be None, 'off' or one of {', '.join(map(repr, SPECULATIVE_MODES))}, "
                         f"got {mode!r}")
    return mode


@dataclass(frozen=True)
class SchedulerConfig:
    """How many requests decode together and how long each may grow; the model's rotary tables, the KV cache and
    the scheduler are all sized from these two."""
    max_seq_len: int
    max_batch_size: int

    def __post_init__(self):
        positive_int("max_seq_len", self.max_seq_len)
        positive_int("max_batch_size", self.max_batch_size)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: its size in bytes per rank (None: max_batch_size x max_seq_len positions), whether
    prompts reuse cached prefixes, and its element type (None: the model's)."""
    prefix_cache: Union[str, bool] = "on"
    memory: Union[int, str, None] = None
    kv_dtype: Optional[str] = None

    def __post_init__(self):
        _set(self, "prefix_cache", prefix_cache_mode(self.prefix_cache))
        memory = self.memory
        if isinstance(memory, str):
            memory = parse_bytes(memory, "kv_cache_memory")
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float))
                                   or not 0 < memory < math.inf):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes (or a size such as '4GiB'), "
                             f"got {self.memory!r}")
        _set(self, "memory", None if memory is None else int(memory))
        if self.kv_dtype is not None and self.kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be None (the model's dtype) or one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_dtype!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: None (off), "ngram" (prompt lookup) or "draft" (draft_model drafts; implied by it)."""
    mode: Optional[str] = None
    draft_model: Optional[str] = None

    def __post_init__(self):
        mode = speculative_mode(self.mode)
        if self.draft_model is not None:
            if not isinstance(self.draft_model, (str, Path)):
                raise ValueError(f"draft_model must be a path, got {self.draft_model!r}")
            if mode not in (None, "draft"):
                raise ValueError(f"speculative={self.mode!r} and draft_model={self.draft_model!r} are two sources of "
                                 "drafts: give one (draft_model implies speculative='draft')")
            mode = "draft"
        elif mode == "draft":
            raise ValueError("speculative='draft' drafts with a draft model: build with draft_model=PATH")
        _set(self, "mode", mode)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallel over model_parallel_size ranks (None: the world size over the stages) times
    pipeline_parallel_size stages, under torchrun."""
    model_parallel_size: Optional[int] = None
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        if self.model_parallel_size is not None:
            positive_int("model_parallel_size", self.model_parallel_size)
        positive_int("pipeline_parallel_size", self.pipeline_parallel_size)

    @property
    def staged(self) -> bool:
        return self.pipeline_parallel_size != 1


@dataclass(frozen=True)
class CompileConfig:
    """The decode step: False (eager), True (compiled on first use), "auto" (compiled once eager decoding has cost
    what compiling would) or an Inductor mode (llama/compilation/compiled_decode.py)."""
    mode: Union[bool, str, None] = "auto"

    def __post_init__(self):
        from llama.compilation.compiled_decode import MODES
        if self.mode is None:
            _set(self, "mode", False)
        elif not any(self.mode is v for v in (False, True)) and self.mode not in MODES:
            raise ValueError(f"compile must be a bool, None or one of {MODES}, got {self.mode!r}")

    @property
    def eager(self) -> bool:
        return self.mode is False

    @property
    def forced(self) -> bool:
        """A compiled step asked for outright (True or a mode), not left to "auto"."""
        return not self.eager and self.mode != "auto"


@dataclass(frozen=True)
class QuantConfig:
    """The quantization scheme the weights load in (a registered QuantScheme, given by name or alias or as the
    object; None: none), its group size (None: the scheme's default), and what a checkpoint written by
    `python -m llama.quantize` records (then it loads as stored, nothing requantized)."""
    scheme: Union[QuantScheme, str, None] = None
    group_size: Optional[int] = None
    stored: Optional[dict] = None

    def __post_init__(self):
        _set(self, "scheme", registry.lookup(self.scheme))
        _set(self, "group_size", registry.checked_group_size(self.scheme, self.group_size))


@dataclass(frozen=True)
class ModelConfig:
    """Where the checkpoint is and what kind it is, resolved once; the device and dtype the model runs in."""
    kind: str
    device: torch.device
    dtype: torch.dtype
    path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    gguf_path: Optional[Path] = None
    hf_dir: Optional[Path] = None
    seed: int = 1
    verify: bool = False
    rope_scaling_factor: Optional[float] = None
    preload: Optional[bool] = None

    def __post_init__(self):
        if self.kind not in CHECKPOINT_KINDS:
            raise ValueError(f"checkpoint kind must be one of {CHECKPOINT_KINDS}, got {self.kind!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not any(self.preload is v for v in (None, True, False)):
            raise ValueError(f"preload must be True, False or None (when the weights fit in memory), got "
                             f"{self.preload!r}")
        if self.rope_scaling_factor is not None:
            r = self.rope_scaling_factor
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 1 <= r < math.inf:
                raise ValueError(f"rope_scaling_factor must be a finite number >= 1, got {r!r}")


@dataclass(frozen=True)
class LlamaConfig:
    """A generator's whole configuration, readable as Llama.config."""
    model: ModelConfig
    scheduler: SchedulerConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tool_style: Optional[str] = None

    def __post_init__(self):
        from llama.config.checks import check
        check(self)

    def summary(self) -> str:
        """One line for the log: what was resolved, in the order a reader looks for it."""
        m = self.model
        where = f"{m.path or 'a model in memory'} ({m.kind}) on {m.device}, {m.dtype}"
        return (f"{where}; max_seq_len={self.scheduler.max_seq_len} max_batch_size={self.scheduler.max_batch_size}; "
                f"quantize={self.quant.scheme and self.quant.scheme.name} group_size={self.quant.group_size}; "
                f"compile={self.compile.mode!r}; "
                f"prefix_cache={self.cache.prefix_cache} kv_cache_memory={self.cache.memory} "
                f"kv_cache_dtype={self.cache.kv_dtype}; speculative={self.speculative.mode}; model_parallel_size="
                f"{self.parallel.model_parallel_size} pipeline_parallel_size={self.parallel.pipeline_parallel_size}")
