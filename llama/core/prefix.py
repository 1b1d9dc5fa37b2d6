"""Reusable KV-cache prefixes: the keys/values of some tokens, taken out of a cache slot once and loaded into
others. Loading reuses the longest common start of its tokens and a new prompt, so only the rest is prefilled:
a few-shot block shared by many prompts, or a conversation whose earlier turns were already computed.
"""

from typing import List, Optional

import torch

from llama.core.kv_cache import KVCache, Snapshot


def common_prefix_len(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Prefix:
    """Keys/values of `tokens` for every layer (on the model's device), plus what scoring them gave."""

    def __init__(self, cache: KVCache, tokens: List[int], kv: Snapshot, logprobs: Optional[List[float]] = None,
                 next_logprobs: Optional[torch.Tensor] = None):
        self.tokens = list(tokens)
        self.kv = kv
        self.logprobs = logprobs or []  # log p(tokens[i+1] | tokens[:i+1])
        self.next_logprobs = next_logprobs  # log-softmax over the token after the prefix, if known
        self.cache = cache
        self.id = cache.register(self)

    @classmethod
    def from_slot(cls, cache: KVCache, slot: int, tokens: List[int], **scores) -> "Prefix":
        return cls(cache, tokens, cache.snapshot(slot, len(tokens)), **scores)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Prefix({len(self.tokens)} tokens)"

    def reusable(self, prompt: List[int]) -> int:
        """Positions of `prompt` this prefix covers; at least the prompt's last token is left to compute, since
        its logits are needed."""
        return min(common_prefix_len(self.tokens, prompt), len(prompt) - 1)

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
