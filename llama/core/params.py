"""Per-request generation parameters and their validation."""

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Sequence

import torch

from llama.tokenizers.text import check_text

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
LogitsProcessor = Callable[[List[int], torch.Tensor], torch.Tensor]


@dataclass
class SamplingParams:
    """How one request is decoded. temperature 0 is greedy; top_k 0 disables top-k; seed None uses the global RNG
    (the reference's behaviour); max_gen_len None means up to the cache's end."""

    temperature: float = 0.6
    top_p: float = 0.9
    top_k: int = 0
    max_gen_len: Optional[int] = None
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: also the k most likely tokens at each position (OpenAI's top_logprobs)
    echo: bool = False
    logits_processors: Sequence[LogitsProcessor] = field(default_factory=tuple)
    grammar: Optional[object] = None  # structured output: a llama.Grammar or {"json_schema": ...} (llama/sample/grammar.py)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # transformers'/vLLM's: divides (or multiplies) the prompt's and output's logits
    speculative: bool = True  # False: never drafted for, where the generator speculates (llama/core/speculative.py)
    prediction: Optional[str] = None  # the output's expected text (OpenAI's Predicted Outputs): drafts, never changes it

    def __post_init__(self):
        _number("temperature", self.temperature)
        if not 0 <= self.temperature < math.inf:  # NaN fails this too
            raise ValueError(f"temperature must be >= 0 and finite (0 is greedy), got {self.temperature}")
        _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _integer("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_gen_len is not None:
            _integer("max_gen_len", self.max_gen_len)
            if self.max_gen_len < 1:
                raise ValueError(f"max_gen_len must be >= 1, got {self.max_gen_len}")
        if self.seed is not None:
            _integer("seed", self.seed)
            if not -(2**63) <= self.seed < 2**63:
                raise ValueError(f"seed must fit in 64 bits (-2**63 <= seed < 2**63), got {self.seed}")
        _integer("top_logprobs", self.top_logprobs)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = tuple(check_text(f"stop[{i}]", s) for i, s in enumerate(self.stop))
        if callable(self.logits_processors):
            self.logits_processors = (self.logits_processors,)
        if not isinstance(self.logits_processors, (list, tuple)) or not all(callable(p) for p in self.logits_processors):
            raise ValueError("logits_processors must be callables (token_ids_so_far, logits) -> logits")
        self.logits_processors = tuple(self.logits_processors)
        for name in ("presence_penalty", "frequency_penalty"):
            _number(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:  # NaN fails this too
                raise ValueError(f"{name} must be in [-2, 2] (0 disables it), got {getattr(self, name)}")
        _number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 and finite (1 disables it), got {self.repetition_penalty}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be True or False, got {self.speculative!r}")
        if self.prediction is not None:
            if not isinstance(self.prediction, str):
                raise ValueError(f"prediction must be a string (the predicted output's text), got "
                                 f"{type(self.prediction).__name__}")
            self.prediction = check_text("prediction", self.prediction)
        if self.grammar is not None:
            from llama.sample.grammar import Grammar  # llguidance is needed only by requests that use a grammar

            self.grammar = Grammar.coerce(self.grammar)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def scores_prompt(self) -> bool:
        """echo with logprobs: the prompt's own tokens get scores too (every prefill position's logits)."""
        return self.echo and self.logprobs

    def with_(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _number(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")


def _integer(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")


_LIST_VALUED = ("stop", "logits_processors")  # a flat list of these is one value for every prompt


def per_prompt(name: str, value, count: int) -> list:
    """Expand a parameter given once or once per prompt into a list of `count` values.

    stop and logits_processors are lists themselves: they are per prompt only as a list of lists.
    """
    per = isinstance(value, (list, tuple)) and (
        name not in _LIST_VALUED or (len(value) > 0 and all(isinstance(v, (list, tuple)) for v in value)))
    if per:
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} values but there are {count} prompts")
        return list(value)
    return [value] * count
