"""Reusable KV-cache prefixes and multi-turn chat sessions.

A Prefix is a snapshot of the keys/values of some tokens, taken out of a cache slot. Loading it into a slot
reuses the longest common start of its tokens and a new prompt, so only the rest is prefilled: a few-shot block
shared by many prompts, or a conversation whose earlier turns were already computed.
"""

from typing import List, Optional, Tuple

import torch


def common_prefix_len(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Prefix:
    """Keys/values of `tokens` for every layer (on the model's device), plus what scoring them gave."""

    def __init__(self, tokens: List[int], kv: List[Tuple[torch.Tensor, torch.Tensor]], logprobs: List[float],
                 next_logprobs: Optional[torch.Tensor]):
        self.tokens = list(tokens)
        self.kv = kv
        self.logprobs = logprobs  # log p(tokens[i+1] | tokens[:i+1])
        self.next_logprobs = next_logprobs  # log-softmax over the token after the prefix, if known

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Prefix({len(self.tokens)} tokens)"

    @classmethod
    def snapshot(cls, model, slot: int, tokens: List[int], logprobs: Optional[List[float]] = None,
                 next_logprobs: Optional[torch.Tensor] = None) -> "Prefix":
        """Copy positions [0, len(tokens)) of cache slot `slot` out of the model."""
        n = len(tokens)
        kv = [(layer.attention.cache_k[slot, :, :n].clone(), layer.attention.cache_v[slot, :, :n].clone())
              for layer in model.layers]
        return cls(tokens, kv, logprobs or [], next_logprobs)

    def load_into(self, model, slot: int, prompt: List[int]) -> int:
        """Write the reusable part of this prefix into cache slot `slot`; return how many positions it covers.

        At least the prompt's last token is left to compute, since its logits are needed.
        """
        n = min(common_prefix_len(self.tokens, prompt), len(prompt) - 1)
        for layer, (k, v) in zip(model.layers, self.kv):
            layer.attention.cache_k[slot, :, :n] = k[:, :n]
            layer.attention.cache_v[slot, :, :n] = v[:, :n]
        return n

    def prompt_logprobs(self, prompt: List[int], n: int) -> List[float]:
        """Log-probabilities of prompt tokens 1..n that this prefix already knows (n = load_into's answer)."""
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


class ChatSession:
    """A conversation that keeps its KV cache between turns: a turn prefills only its new tokens.

    The prompt of each turn is the Llama 2 template of the whole dialog, so the answer is the one
    chat_completion gives for that dialog; the cache of the previous turn covers its common start.
    """

    def __init__(self, llama, system: Optional[str] = None):
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system must be a str, got {type(system).__name__}")
        self.llama = llama
        self.dialog = [{"role": "system", "content": system}] if system else []
        self.cache: Optional[Prefix] = None
        self.last_prefilled = 0  # tokens the last turn actually computed (its prompt minus the reused start)

    def send(self, message: str, **params) -> str:
        """Add a user message and return the assistant's reply."""
        return "".join(self.stream(message, **params))

    def stream(self, message: str, **params):
        """Add a user message and yield the reply as text deltas; the turn is recorded once it completes."""
        if not isinstance(message, str):
            raise ValueError(f"message must be a str, got {type(message).__name__}")
        if params.get("echo"):
            raise ValueError("echo is not available in a chat session: the dialog so far is session.dialog")
        llama = self.llama
        dialog = self.dialog + [{"role": "user", "content": message}]
        tokens = llama.formatter.encode_dialog_prompt(dialog)
        if len(tokens) >= llama.max_seq_len:
            raise ValueError(
                f"the conversation would need {len(tokens)} prompt tokens, more than max_seq_len={llama.max_seq_len} "
                "allows: start a new session or build the generator with a larger max_seq_len"
            )
        # The template already holds the history; the cache only spares recomputing its common start.
        row = llama._rows([tokens], llama._params(1, **params), prefix=self.cache, chat=True)[0]
        return self._turn(dialog, row)

    def _turn(self, dialog, row):
        llama = self.llama
        with llama.using_cache(streaming=True):
            for deltas in llama._run([row]):
                for _, text in deltas:
                    yield text
            self.last_prefilled = len(row.prompt) - row.reused
            cached = row.prompt + row.generated[: row.fed]
            self.cache = Prefix.snapshot(llama.model, slot=0, tokens=cached)
        self.dialog = dialog + [{"role": "assistant", "content": row.stream.text}]
