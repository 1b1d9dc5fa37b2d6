"""Prompt-lookup drafting: guess the next tokens by finding the text's last few tokens earlier in the prompt or the
output and copying what followed them there (Saxena's prompt lookup decoding; llama.cpp's and vLLM's n-gram
speculation). It needs no second model and pays off on input-grounded work: summaries, edits, code, extraction.

The draft is a pure function of the tokens, so it is the same on every rank and in every batch.
"""

from typing import Dict, List, Sequence, Tuple

MAX_NGRAM, MIN_NGRAM = 3, 1


class NgramIndex:
    """For n = MIN_NGRAM..MAX_NGRAM, the latest place each n-gram of a growing token list occurs with a token after
    it; kept incrementally, so a draft costs a dictionary look-up per n rather than a scan of the text."""

    def __init__(self) -> None:
        self._last: Dict[Tuple[int, ...], int] = {}  # n-gram -> index of the token that followed its latest occurrence
        self._seen = 0  # tokens[:_seen] are indexed (each as the token following an n-gram)

    def _update(self, tokens: Sequence[int]) -> None:
        if len(tokens) < self._seen:  # the list was cut (a stop string): index it afresh
            self._last, self._seen = {}, 0
        for end in range(max(self._seen, 1), len(tokens)):  # tokens[end] follows the n-grams ending before it
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._last[tuple(tokens[end - n : end])] = end
        self._seen = max(self._seen, len(tokens))

    def draft(self, tokens: Sequence[int], k: int) -> List[int]:
        """k tokens that followed the latest earlier occurrence of the longest of tokens' last n-grams (n = MAX_NGRAM
        down to MIN_NGRAM), copied on past the end as LZ77 does (a loop of period p drafts its next k tokens); []
        when none occurred before."""
        if k <= 0:
            return []
        self._update(tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(tokens) <= n:
                continue
            at = self._last.get(tuple(tokens[len(tokens) - n :]))
            if at is not None:
                out: List[int] = []
                for j in range(at, at + k):
                    out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
                return out
        return []
