"""Reusable KV-cache prefixes: the pool blocks (llama/core/scheduling/block_pool.py) that hold the keys/values of some tokens,
kept referenced while the Prefix lives. A prompt that continues one shares its full blocks and copies the partial
last one (copy on write), so only the rest is prefilled: a few-shot block shared by many prompts, or a conversation
whose earlier turns were already computed (llama/core/frontend/session.py).
"""

import weakref
from dataclasses import dataclass
from typing import List, Optional

import torch

from llama.core.worker.kv_cache import KVCache


def common_prefix_len(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Pin:
    """A prefix's references to its blocks, released once (KVCache.drain) after close() or collection."""

    blocks: List[int]
    released: bool = False


class Prefix:
    """Keys/values of `tokens` in pool blocks of `cache` (positions p in blocks[p // block_size]), plus what scoring
    them gave. The blocks stay referenced, so nothing evicts or overwrites them, until close() or until the Prefix
    is garbage collected; a closed prefix still works, its continuations just compute every position."""

    def __init__(self, cache: KVCache, tokens: List[int], blocks: List[int], logprobs: Optional[List[float]] = None,
                 next_logprobs: Optional[torch.Tensor] = None):
        self.tokens = list(tokens)
        self.blocks = list(blocks)
        self.logprobs = logprobs or []  # log p(tokens[i+1] | tokens[:i+1])
        self.next_logprobs = next_logprobs  # log-softmax over the token after the prefix, if known
        self.cache = cache
        self.stale = False  # a direct model call (outside the runner) may have overwritten the blocks
        self._pin = Pin(self.blocks)
        self._finalizer = weakref.finalize(self, cache.drop, self._pin)
        self.id = cache.register(self)

    @classmethod
    def from_slot(cls, cache: KVCache, slot: int, tokens: List[int], **scores) -> "Prefix":
        """The prefix of cache row `slot`, which has just computed `tokens` (the caller still holds the cache)."""
        return cls(cache, tokens, cache.keep(slot, len(tokens)), **scores)

    def close(self) -> None:
        """Give the blocks back to the pool (at the cache's next step); continuations then compute everything."""
        self._finalizer()

    def __enter__(self) -> "Prefix":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Prefix({len(self.tokens)} tokens)"

    def reusable(self, prompt: List[int]) -> int:
        """Positions of `prompt` this prefix covers; at least the prompt's last token is left to compute, since
        its logits are needed. 0 once its blocks are released or may have been overwritten."""
        if self._pin.released or self.stale:
            return 0
        return min(common_prefix_len(self.tokens, prompt), len(prompt) - 1)

    def full_blocks(self, prompt: List[int]) -> List[int]:
        """The blocks a continuation of `prompt` shares: those its reusable positions fill."""
        return self.blocks[: self.reusable(prompt) // self.cache.block_size]

    def prompt_logprobs(self, prompt: List[int], n: int) -> List[float]:
        """Log-probabilities of prompt tokens 1..n that this prefix already knows (n = reusable(prompt))."""
        known = self.logprobs[: max(n - 1, 0)]
        if n == 0:
            return []
        if n < len(self.tokens) and prompt[n] != self.tokens[n]:  # logprobs[n - 1] scores tokens[n], not prompt[n]
            raise ValueError(f"the prompt leaves this prefix at token {n}: the score of its token {n} is unknown")
        if n - 1 < len(self.logprobs):
            return known + [self.logprobs[n - 1]]
        if self.next_logprobs is None:
            raise ValueError("this prefix has no scores for the token after it: echo with logprobs is unavailable")
        return known + [float(self.next_logprobs[prompt[n]])]
