"""Every `LLAMA_*` environment variable, read and checked in one place, once per process.

Modules ask `settings.get()` for typed values instead of reading os.environ: a bad value is refused with the
variable's name and what it accepts, wherever it is first needed, and the decode loop reads no environment.
Tests (and benchmarks) that change a variable inside a process call `reset()` (or `reload()`) so the next `get()`
reads the environment again; tests/conftest.py does so on every monkeypatch of the environment. The table of
variables is docs/settings.md. LLAMA_CPU_AVX512 is the exception: the C++ kernels read it on every call.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclass(frozen=True)
class Settings:
    cache: Path  # LLAMA_CACHE: kernels, int4 packs, compiled steps, the demo and default models
    device: Optional[torch.device]  # LLAMA_DEVICE: None picks cuda:LOCAL_RANK when CUDA is available, else cpu
    dtype: Optional[torch.dtype]  # LLAMA_DTYPE: None picks by device
    memory_limit: Optional[int]  # LLAMA_MEMORY_LIMIT in bytes: None reads MemAvailable
    cpu_kernels: bool  # LLAMA_CPU_KERNELS
    fused_decode: bool  # LLAMA_FUSED_DECODE
    gguf_blocks: bool  # LLAMA_GGUF_BLOCKS
    ggml_arith: bool  # LLAMA_GGML_ARITH
    gguf_activations: str  # LLAMA_GGUF_ACTIVATIONS: "int16" (default), "float" or "int8" (llama.cpp's blocks)
    int4_cache: bool  # LLAMA_INT4_CACHE
    compile_cache: bool  # LLAMA_COMPILE_CACHE
    offline: bool  # LLAMA_OFFLINE: never fetch the default model
    api_key: Optional[str]  # LLAMA_API_KEY: one more bearer key the server accepts
    async_decode: Optional[bool]  # LLAMA_ASYNC_DECODE: None (auto) queues decode steps ahead on CUDA only
    speculative_timing: str  # LLAMA_SPECULATIVE_TIMING: "prior" drafts by the tokens alone
    models_debug: bool  # LLAMA_MODELS_DEBUG: llama-models' own switch, "1" prints Llama4.generate's input


def _text(name: str) -> str:
    return os.environ.get(name, "").strip()


def flag(name: str, default: bool) -> bool:
    """An on/off variable: unset or empty is the default."""
    text = _text(name).lower()
    if not text:
        return default
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise ValueError(f"{name} must be one of {TRUE + FALSE} (or unset), got {os.environ[name]!r}")


def auto_flag(name: str) -> Optional[bool]:
    """An on/off variable whose unset, empty or 'auto' value (None) lets the package decide."""
    text = _text(name).lower()
    if text in ("", "auto"):
        return None
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise ValueError(f"{name} must be auto or one of {TRUE + FALSE} (or unset), got {os.environ[name]!r}")


def parse_bytes(text: str, name: str = "LLAMA_MEMORY_LIMIT") -> int:
    """'12G', '512M', '1000000' -> bytes; ValueError naming the variable otherwise."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _SUFFIX and t[-1:] else ""
    try:
        value = float(t[: len(t) - len(unit)]) * _SUFFIX[unit]
    except ValueError:
        raise ValueError(f"{name} must be a byte count such as 8G, 512M or 1000000, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive, finite byte count, got {text!r}")
    return int(value)


def _device(name: str) -> Optional[torch.device]:
    text = _text(name)
    if not text:
        return None
    try:
        return torch.device(text)
    except RuntimeError:
        raise ValueError(f"{name} must name a device such as cpu, cuda or cuda:1, got {text!r}") from None


def _dtype(name: str) -> Optional[torch.dtype]:
    text = _text(name)
    if text and text not in DTYPES:
        raise ValueError(f"{name} must be one of {sorted(DTYPES)}, got {text!r}")
    return DTYPES[text] if text else None


GGUF_ACTIVATIONS = ("int16", "float", "int8")
# "measured": whether a draft pays is decided from step times measured on this machine; "prior": from the prior
# costs alone, so the drafts (and the acceptance counts) depend on the tokens only, whatever the load.
SPECULATIVE_TIMINGS = ("measured", "prior")


def _choice(name: str, choices, default: str) -> str:
    text = _text(name).lower()
    if text and text not in choices:
        raise ValueError(f"{name} must be one of {list(choices)} (or unset), got {os.environ[name]!r}")
    return text or default


def read() -> Settings:
    """The settings as the environment says now (every variable checked)."""
    cache = _text("LLAMA_CACHE")
    return Settings(
        cache=Path(cache).expanduser() if cache else Path.home() / ".cache" / "llama",
        device=_device("LLAMA_DEVICE"),
        dtype=_dtype("LLAMA_DTYPE"),
        memory_limit=parse_bytes(_text("LLAMA_MEMORY_LIMIT")) if _text("LLAMA_MEMORY_LIMIT") else None,
        cpu_kernels=flag("LLAMA_CPU_KERNELS", True),
        fused_decode=flag("LLAMA_FUSED_DECODE", True),
        gguf_blocks=flag("LLAMA_GGUF_BLOCKS", True),
        ggml_arith=flag("LLAMA_GGML_ARITH", False),
        gguf_activations=_choice("LLAMA_GGUF_ACTIVATIONS", GGUF_ACTIVATIONS, "int16"),
        int4_cache=flag("LLAMA_INT4_CACHE", True),
        compile_cache=flag("LLAMA_COMPILE_CACHE", True),
        offline=flag("LLAMA_OFFLINE", False),
        api_key=_text("LLAMA_API_KEY") or None,
        async_decode=auto_flag("LLAMA_ASYNC_DECODE"),
        speculative_timing=_choice("LLAMA_SPECULATIVE_TIMING", SPECULATIVE_TIMINGS, "measured"),
        models_debug=_text("LLAMA_MODELS_DEBUG") == "1",  # llama-models compares with "1", so do we
    )


_current: Optional[Settings] = None


def get() -> Settings:
    """This process's settings, read from the environment on first use."""
    global _current
    if _current is None:
        _current = read()
    return _current


def reset() -> None:
    """Forget the settings read so far: the next get() reads the environment again."""
    global _current
    _current = None


def reload() -> Settings:
    reset()
    return get()


def cache_dir() -> Path:
    """Where llama keeps what it builds or fetches once: $LLAMA_CACHE, default ~/.cache/llama."""
    return get().cache
