"""The state of one sequence being generated, shared by the static decode loop and the engine."""

from dataclasses import dataclass, field
from typing import List, Optional

from .params import SamplingParams
from .prefix import Prefix
from .textstream import TextStream


@dataclass
class Row:
    """One sequence being generated: one sample of one prompt, in one cache slot."""

    prompt: List[int]
    params: SamplingParams
    max_new: int
    stream: TextStream
    sample: int = 0
    prefix: Optional[Prefix] = None
    generated: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    prompt_logprobs: List[float] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "eos", "stop" or "length"
    fed: int = 0  # generated tokens whose keys/values are in the cache
    reused: int = 0  # prompt positions taken from the prefix instead of computed

    def advance(self, tok: int, eos_id: int, logprob: Optional[float] = None) -> str:
        """Take one sampled token; return the text now safe to release. While unfinished, the caller feeds
        `tok` at position `next_pos` in its next forward pass (so it counts as fed)."""
        if tok == eos_id:
            self.finish_reason = "eos"
            return self.stream.finish()
        self.generated.append(tok)
        if logprob is not None and self.params.logprobs:
            self.logprobs.append(logprob)
        text = self.stream.add(tok)
        if self.stream.stopped:
            self.finish_reason = "stop"
            keep = self.stream.tokens_before_stop()
            del self.generated[keep:], self.logprobs[keep:]
            self.fed = min(self.fed, keep)
        elif len(self.generated) >= self.max_new:
            self.finish_reason = "length"
        else:
            self.fed = len(self.generated)
        return text + self.stream.finish() if self.finish_reason is not None else text

    @property
    def next_pos(self) -> int:
        return len(self.prompt) + len(self.generated) - 1
