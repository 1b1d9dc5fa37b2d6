"""Quantization schemes as objects, registered by name: what Llama.build's `quantize=` and `python -m llama.quantize
--scheme` accept. Loading, the memory check, stored checkpoints and the command lines ask a QuantScheme, never
compare its name, so adding a scheme is one register() call (docs/architecture.md, "Extension points").

Import llama.quantization.schemes rather than this module: it registers the built-in schemes (int8, int8-dynamic,
int4) and re-exports the registry. GGUF's own block formats (Q4_K, Q8_0 ...: llama/quantization/gguf_blocks.py) are
not schemes: they are how a GGUF file's weights are held when quantize= is None (llama/formats/gguf_quants.py),
never something a float model is quantized to.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn

from llama.quantization.stored import StoredLayout


def _device_default() -> Optional[torch.dtype]:
    return None


def _positive_group(group_size) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group size must be a positive integer, got {group_size!r}")
    return group_size


@dataclass(frozen=True)
class QuantScheme:
    """One quantization scheme.

    quantize(model, group_size): quantizes every linear layer of model (or of one layer block) in place, already
        fused, and returns it; layers already quantized are left alone. group_size is None for an ungrouped scheme.
    weight_bits, scale_bytes: a linear weight's bits per value and its scales' bytes per group (per output row when
        ungrouped): the memory check's estimate (llama/loading/memory.py).
    group_size: the default group size of a grouped scheme (Llama.build's group_size= applies), else None;
        check_group_size checks a requested one.
    activation_dtype(): the activation dtype it runs in when the caller names none (None: the device's default).
    devices: the device types it runs on (None: any).
    storage: how `python -m llama.quantize` stores it (llama/quantization/stored.py), None if it cannot be stored.
    stored_as: the stored scheme whose checkpoints it loads without requantizing from scratch (int8-dynamic takes
        stored int8 codes); a storable scheme's own name by default.
    """

    name: str
    quantize: Callable[[nn.Module, Optional[int]], nn.Module]
    weight_bits: int
    scale_bytes: int = 0
    aliases: Tuple[str, ...] = ()
    group_size: Optional[int] = None
    check_group_size: Callable[[object], int] = _positive_group
    activation_dtype: Callable[[], Optional[torch.dtype]] = _device_default
    devices: Optional[Tuple[str, ...]] = None
    storage: Optional[StoredLayout] = None
    stored_as: Optional[str] = None

    def __post_init__(self):
        """TypeError/ValueError naming the field, at construction rather than at first use."""
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"QuantScheme name must be a non-empty string, got {self.name!r}")
        for field in ("aliases", "devices"):
            value = getattr(self, field)
            if not (value is None and field == "devices") and (
                    not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value)):
                raise TypeError(f"QuantScheme {self.name!r}: {field} must be a tuple of non-empty strings, got "
                                f"{value!r}")
        for field in ("quantize", "check_group_size", "activation_dtype"):
            if not callable(getattr(self, field)):
                raise TypeError(f"QuantScheme {self.name!r}: {field} must be callable, got {getattr(self, field)!r}")
        for field, least in (("weight_bits", 1), ("scale_bytes", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"QuantScheme {self.name!r}: {field} must be an integer >= {least}, got {value!r}")
        if self.storage is not None and not isinstance(self.storage, StoredLayout):
            raise TypeError(f"QuantScheme {self.name!r}: storage must be a StoredLayout or None, got {self.storage!r}")
        if self.group_size is not None:
            self.check_group_size(self.group_size)

    @property
    def names(self) -> Tuple[str, ...]:
        return (self.name, *self.aliases)

    def linear_bytes(self, n: int, k: int, group_size: Optional[int] = None) -> int:
        """Bytes of an (n, k) linear weight and its scales."""
        group = k if self.group_size is None else group_size or self.group_size
        return n * k * self.weight_bits // 8 + self.scale_bytes * n * -(-k // max(group, 1))

    def runs_on(self, device) -> bool:
        return self.devices is None or torch.device(device).type in self.devices

    def check_device(self, device) -> None:
        """ValueError unless the scheme runs on this device, naming those that do."""
        if not self.runs_on(device):
            there = tuple(s.name for s in _SCHEMES.values() if s.runs_on(device))
            raise ValueError(f"quantize={self.name!r} runs on {' and '.join(self.devices)} only (the model is on "
                             f"{torch.device(device)}): use one of {there} there")

    def loads(self, stored: "QuantScheme") -> bool:
        """Whether a checkpoint stored in scheme `stored` loads as this scheme without requantizing its floats."""
        return (self.stored_as or (self.name if self.storage is not None else None)) == stored.name


_SCHEMES: Dict[str, QuantScheme] = {}  # name -> scheme, in registration order
_NAMES: Dict[str, str] = {}  # name or alias -> name


def register(scheme: QuantScheme) -> QuantScheme:
    """Make a scheme available by its name and aliases; ValueError if one is taken. Returns the scheme."""
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"register() takes a QuantScheme, got {type(scheme).__name__}")
    taken = [n for n in scheme.names if n in _NAMES]
    if taken or len(set(scheme.names)) != len(scheme.names):
        raise ValueError(f"quantization scheme names must be unique: {taken or list(scheme.names)} already taken")
    _SCHEMES[scheme.name] = scheme
    _NAMES.update({n: scheme.name for n in scheme.names})
    return scheme


def unregister(name: str) -> None:
    """Remove a scheme (by its name) and its aliases."""
    scheme = _SCHEMES.pop(name, None)
    if scheme is None:
        raise ValueError(f"no quantization scheme is registered as {name!r}; registered: {names()}")
    for n in scheme.names:
        del _NAMES[n]


def names() -> Tuple[str, ...]:
    """The registered schemes' names, in registration order."""
    return tuple(_SCHEMES)


def choices() -> Tuple[str, ...]:
    """What a command line's --quantize accepts: every name and alias."""
    return tuple(_NAMES)


def get(name: str) -> QuantScheme:
    """The scheme registered under this name or alias; ValueError naming the valid ones otherwise."""
    if not isinstance(name, str) or name not in _NAMES:
        aliases = {a: n for a, n in _NAMES.items() if a != n}
        raise ValueError(f"quantize must be one of {names()}{f' (aliases: {aliases})' if aliases else ''} or None, "
                         f"got {name!r}")
    return _SCHEMES[_NAMES[name]]


def lookup(quantize: Union[str, QuantScheme, None]) -> Optional[QuantScheme]:
    """Llama.build's quantize= as a scheme: None stays None, a QuantScheme is itself, a name is looked up (get)."""
    if quantize is None or isinstance(quantize, QuantScheme):
        return quantize
    return get(quantize)


def storable() -> Tuple[str, ...]:
    """The names of the schemes `python -m llama.quantize` can store."""
    return tuple(s.name for s in _SCHEMES.values() if s.storage is not None)


def grouped() -> Tuple[str, ...]:
    """The names of the schemes that take a group size."""
    return tuple(s.name for s in _SCHEMES.values() if s.group_size is not None)


def checked_group_size(scheme: Optional[QuantScheme], group_size) -> Optional[int]:
    """Llama.build's group_size= unchanged (None: the scheme's default applies), refused when the scheme takes
    none or the size is not one it takes."""
    if group_size is None:
        return None
    if scheme is None or scheme.group_size is None:
        which = " or ".join(map(repr, grouped())) or "a grouped scheme"
        raise ValueError(f"group_size applies to quantize={which} only, got group_size={group_size!r} with "
                         f"quantize={None if scheme is None else scheme.name!r}")
    return scheme.check_group_size(group_size)
