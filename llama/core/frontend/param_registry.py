"""Sampling parameters declared once. A `Param` holds everything about one parameter: its name, type, default,
bounds (or a check of its own), its OpenAI wire field if it has one, whether the batch CLI takes it per row, and
the logits transform it contributes. Everything else reads the registry instead of repeating it:
`SamplingParams` (llama/core/frontend/params.py: its attributes and validation), the server's request parsing
(llama/serve/protocol.py: allow-list, bounds, HTTP 400 messages), the batch CLI's per-row fields
(llama/cli/batch.py), and the sampler and the draft model (which apply the active transforms).

The built-in parameters are declared in llama/core/frontend/params.py, which registers them on import; import these
functions from there, so the built-ins are in. `register` adds one at run time (a plug-in, or a test),
`unregister` removes it. A parameter registered after a SamplingParams was built reads as its default there.
"""

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

# (row (V,), prompt ids, generated ids, the SamplingParams) -> None: changes one request's logits row in place.
# It runs in the sampler on the host's token lists, after logits processors and a grammar's mask, and in the draft
# model's picks; it must not raise (validate the parameter's value in its declaration instead).
Transform = Callable[[object, Sequence[int], Sequence[int], object], None]

_SAME = object()  # a Wire setting that takes the parameter's own


@dataclass(frozen=True)
class Wire:
    """How a parameter reads from an OpenAI request body. field: its name there (default: the parameter's);
    default: its value when absent or null (default: the parameter's); lo/hi: bounds where they differ from the
    library's (a bound given here is closed unless its *_open says otherwise); read: maps the raw value first."""

    field: Optional[str] = None
    default: object = _SAME
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: Optional[bool] = None
    hi_open: Optional[bool] = None
    read: Optional[Callable[[object], object]] = None


@dataclass(frozen=True)
class Param:
    """One sampling parameter. kind float, int or bool: type and bounds are checked here, with messages naming the
    parameter and the limit (limit: the phrase after "must" where the bounds' own wording will not do; hint: what
    follows it, e.g. "(0 disables it)"); kind None: check alone. check: further validation (and normalisation) of
    a value, raising ValueError. A default of None means the parameter may be None (unset). transform: applied
    wherever the value is not the default; one transform shared by several parameters runs once."""

    name: str
    kind: Optional[type] = None
    default: object = None
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    hint: str = ""
    limit: str = ""
    check: Optional[Callable[[object], object]] = None
    wire: Optional[Wire] = None  # None: not an OpenAI field, or one the server maps itself (max_tokens, stop, ...)
    batch: bool = True  # a field of the batch CLI's input rows
    list_valued: bool = False  # a list by nature: per prompt only as a list of lists (llama/core/frontend/params.py)
    transform: Optional[Transform] = None

    def validate(self, value):
        """The value as SamplingParams holds it; ValueError names the parameter and the limit."""
        if value is None and self.default is None:
            return None
        if self.kind is bool and not isinstance(value, bool):
            raise ValueError(f"{self.name} must be True or False, got {value!r}")
        if self.kind in (int, float):
            numeric = numbers.Integral if self.kind is int else numbers.Real
            if isinstance(value, bool) or not isinstance(value, numeric):
                raise ValueError(f"{self.name} must be {'an integer' if self.kind is int else 'a number'}, got "
                                 f"{value!r}")
            if not _within(value, self.lo, self.hi, self.lo_open, self.hi_open):  # NaN fails this too
                hint = f" {self.hint}" if self.hint else ""
                raise ValueError(f"{self.name} must {self.limit or self._limit()}{hint}, got {value}")
        return self.check(value) if self.check is not None else value

    def _limit(self) -> str:
        lo, hi = self.lo, self.hi
        if hi is None or hi == math.inf:
            finite = " and finite" if hi == math.inf else ""
            return f"be {'>' if self.lo_open else '>='} {lo}{finite}" if lo is not None else "be finite"
        if lo is None:
            return f"be {'<' if self.hi_open else '<='} {hi}"
        return f"be in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"

    @property
    def field(self) -> Optional[str]:
        """Its OpenAI request field, or None."""
        return None if self.wire is None else self.wire.field or self.name

    def from_wire(self, body: Dict):
        """The value of a request body's field (its default when absent or null); ValueError with the message the
        server's HTTP 400 carries (naming the field and the limit)."""
        w, name = self.wire, self.field
        v = body.get(name)
        if w.read is not None:
            v = w.read(v)
        if v is None:
            return self.default if w.default is _SAME else w.default
        if self.kind is bool:
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be true or false, got {v!r}")
            return v
        lo, lo_open = (self.lo, self.lo_open) if w.lo is None else (w.lo, bool(w.lo_open))
        hi, hi_open = (self.hi, self.hi_open) if w.hi is None else (w.hi, bool(w.hi_open))
        if self.kind is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            lo = None if lo is None else lo + 1 if lo_open else lo  # as closed integer bounds
            hi = None if hi is None or hi == math.inf else hi - 1 if hi_open else hi
            if not _within(v, lo, hi, False, False):
                limit = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
                raise ValueError(f"{name} must be {limit}, got {v}")
            return v
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
        lo, hi = -math.inf if lo is None else lo, math.inf if hi is None else hi
        if not _within(v, lo, hi, lo_open, hi_open):
            close = ")" if hi_open and math.isfinite(hi) else "]"  # a finite number is below inf either way
            raise ValueError(f"{name} must be in {'(' if lo_open else '['}{float(lo)}, {float(hi)}{close}, got {v}")
        return float(v)


def _within(v, lo, hi, lo_open: bool, hi_open: bool) -> bool:
    above = lo is None or (lo < v if lo_open else lo <= v)
    below = hi is None or (v < hi if hi_open else v <= hi)
    return above and below


# ------------------------------------------------------------------------------------------------ the registry
_params: Tuple[Param, ...] = ()  # in declaration order; replaced whole, so a reader never sees it change mid-loop
_by_name: Dict[str, Param] = {}
# SamplingParams' own names: no parameter may shadow them
RESERVED = ("with_", "values", "transforms", "transform_logits", "penalized", "scores_prompt")


def register(param: Param) -> Param:
    """Add a sampling parameter; every path (library, server, batch CLI, sampler, draft model) takes it from now."""
    global _params, _by_name
    if not isinstance(param, Param):
        raise TypeError(f"register takes a Param, got {type(param).__name__}")
    if not param.name.isidentifier() or param.name.startswith("_") or param.name in RESERVED:
        raise ValueError(f"a sampling parameter's name must be a public identifier not in {RESERVED}, got "
                         f"{param.name!r}")
    if param.name in _by_name:
        raise ValueError(f"the sampling parameter {param.name!r} is already registered")
    if param.wire is not None and param.kind not in (int, float, bool):
        raise ValueError(f"{param.name}: a wire field needs kind int, float or bool (got {param.kind!r}); map "
                         "other fields in llama/serve/protocol.py")
    fields = {p.field for p in _params} - {None}
    if param.field in fields:
        raise ValueError(f"{param.name}: the wire field {param.field!r} is already another parameter's")
    _params = _params + (param,)
    _by_name = {p.name: p for p in _params}
    return param


def unregister(name: str) -> None:
    global _params, _by_name
    if name not in _by_name:
        raise ValueError(f"no sampling parameter {name!r} is registered")
    _params = tuple(p for p in _params if p.name != name)
    _by_name = {p.name: p for p in _params}


def params() -> Tuple[Param, ...]:
    return _params


def get(name: str) -> Optional[Param]:
    return _by_name.get(name)


def names() -> Tuple[str, ...]:
    return tuple(p.name for p in _params)


def wire_params() -> Tuple[Param, ...]:
    """The parameters the server reads from a request body itself, in declaration order."""
    return tuple(p for p in _params if p.wire is not None)


def batch_names() -> Tuple[str, ...]:
    """The parameters a batch CLI input row may set."""
    return tuple(p.name for p in _params if p.batch)


def active_transforms(values) -> Tuple[Transform, ...]:
    """The transforms of the parameters `values` (a SamplingParams) sets to something other than their default,
    each once, in declaration order."""
    out = []
    for p in _params:
        if p.transform is not None and p.transform not in out and getattr(values, p.name, p.default) != p.default:
            out.append(p.transform)
    return tuple(out)
