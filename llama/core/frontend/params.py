"""Per-request generation parameters: the built-in ones declared (llama/core/frontend/param_registry.py), and
SamplingParams, which holds one attribute per registered parameter. Import the registry's functions from here
(register, unregister, names, wire_params, batch_names): this module has registered the built-in parameters."""

import math
from typing import Callable, List, Sequence

import torch

from llama.core.frontend import param_registry
from llama.core.frontend.param_registry import Param, Wire, batch_names, names, register, unregister, wire_params  # noqa: F401
from llama.sample.sampling import penalize
from llama.tokenizers.text import check_text

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
LogitsProcessor = Callable[[List[int], torch.Tensor], torch.Tensor]


def _stop(value) -> tuple:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"stop must be a list of non-empty strings, got {value!r}")
    return tuple(check_text(f"stop[{i}]", s) for i, s in enumerate(value))


def _processors(value) -> tuple:
    if callable(value):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(callable(p) for p in value):
        raise ValueError("logits_processors must be callables (token_ids_so_far, logits) -> logits")
    return tuple(value)


def _prediction(value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"prediction must be a string (the predicted output's text), got {type(value).__name__}")
    return check_text("prediction", value)


def _grammar(value):
    from llama.sample.grammar import Grammar  # llguidance is needed only by requests that use a grammar

    return Grammar.coerce(value)


def _penalties(row: torch.Tensor, prompt: Sequence[int], generated: Sequence[int], p: "SamplingParams") -> None:
    """The three penalties' one transform (llama/sample/sampling.py penalize): repetition, then presence and
    frequency, in one pass as before."""
    penalize(row, prompt, generated, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)


# The built-in parameters, in the order they are validated (and listed: SamplingParams' repr, the batch CLI's
# message). temperature 0 is greedy; top_k 0 disables top-k; seed None uses the global RNG (the reference's
# behaviour); max_gen_len None means up to the cache's end. The server's defaults are OpenAI's (temperature and
# top_p 1) and its temperature stops at 2.
BUILTIN = (
    Param("temperature", float, 0.6, lo=0, hi=math.inf, hi_open=True, hint="(0 is greedy)",
          wire=Wire(default=1.0, hi=2.0)),
    Param("top_p", float, 0.9, lo=0, hi=1, lo_open=True, wire=Wire(default=1.0)),
    Param("top_k", int, 0, lo=0, hint="(0 disables it)", wire=Wire(read=lambda v: 0 if v == -1 else v)),  # -1: off
    Param("max_gen_len", int, None, lo=1),  # the server's max_tokens / max_completion_tokens
    Param("seed", int, None, lo=-(2**63), hi=2**63, hi_open=True, limit="fit in 64 bits (-2**63 <= seed < 2**63)",
          wire=Wire()),
    Param("stop", default=(), check=_stop, list_valued=True),  # the server's stop: at most 16
    Param("logprobs", default=False),  # the server's logprobs (completions: a count, chat: a flag)
    # with logprobs: also the k most likely tokens at each position (OpenAI's top_logprobs)
    Param("top_logprobs", int, 0, lo=0, hi=MAX_TOP_LOGPROBS),
    Param("echo", default=False, batch=False),
    Param("logits_processors", default=(), check=_processors, batch=False, list_valued=True),  # server: logit_bias
    # OpenAI's: subtracted once from every token already generated / per occurrence among the generated tokens
    Param("presence_penalty", float, 0.0, lo=-2, hi=2, hint="(0 disables it)", wire=Wire(), transform=_penalties),
    Param("frequency_penalty", float, 0.0, lo=-2, hi=2, hint="(0 disables it)", wire=Wire(), transform=_penalties),
    # transformers'/vLLM's: divides (or multiplies) the prompt's and output's logits
    Param("repetition_penalty", float, 1.0, lo=0, hi=math.inf, lo_open=True, hi_open=True, hint="(1 disables it)",
          wire=Wire(), transform=_penalties),
    # False: never drafted for, where the generator speculates (llama/core/speculation/speculative.py)
    Param("speculative", bool, True, batch=False),
    # the output's expected text (OpenAI's Predicted Outputs): drafts, never changes it; the server's prediction
    Param("prediction", check=_prediction, batch=False),
    # structured output: a llama.Grammar or {"json_schema": ...} (llama/sample/grammar.py); the server's
    # response_format
    Param("grammar", check=_grammar, batch=False),
)
for _p in BUILTIN:
    param_registry.register(_p)


class SamplingParams:
    """How one request is decoded: one attribute per registered parameter (llama/core/frontend/param_registry.py; the
    built-in ones above), each validated on construction with a ValueError naming it and its limit."""

    def __init__(self, **values):
        unknown = set(values) - set(param_registry.names())
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        for p in param_registry.params():
            setattr(self, p.name, p.validate(values[p.name]) if p.name in values else p.default)
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True")

    def __getattr__(self, name: str):
        """A parameter registered after this was built reads as its default."""
        p = param_registry.get(name)
        if p is None:
            raise AttributeError(f"'SamplingParams' object has no attribute {name!r}")
        return p.default

    def values(self) -> dict:
        return {name: getattr(self, name) for name in param_registry.names()}

    def __eq__(self, other) -> bool:
        return isinstance(other, SamplingParams) and self.values() == other.values()

    __hash__ = None  # mutable, as the dataclass it was

    def __repr__(self) -> str:
        return f"SamplingParams({', '.join(f'{k}={v!r}' for k, v in self.values().items())})"

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def transforms(self) -> tuple:
        """The logits transforms this request's parameters switch on (penalties, and any registered one)."""
        return param_registry.active_transforms(self)

    def transform_logits(self, row: torch.Tensor, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
        """Apply the active transforms to one logits row (V,) in place: the sampler's and the draft model's one
        way to do it, so a drafted token is picked from the logits the target will sample."""
        for transform in self.transforms:
            transform(row, prompt, generated, self)
        return row

    @property
    def scores_prompt(self) -> bool:
        """echo with logprobs: the prompt's own tokens get scores too (every prefill position's logits)."""
        return self.echo and self.logprobs

    def with_(self, **changes) -> "SamplingParams":
        return SamplingParams(**{**self.values(), **changes})


def per_prompt(name: str, value, count: int) -> list:
    """Expand a parameter given once or once per prompt into a list of `count` values.

    A list-valued parameter (stop, logits_processors) is per prompt only as a list of lists.
    """
    p = param_registry.get(name)
    list_valued = p is not None and p.list_valued
    per = isinstance(value, (list, tuple)) and (
        not list_valued or (len(value) > 0 and all(isinstance(v, (list, tuple)) for v in value)))
    if per:
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} values but there are {count} prompts")
        return list(value)
    return [value] * count
