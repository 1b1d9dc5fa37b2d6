"""Prompt-lookup drafting: guess the next tokens by finding the text's last few tokens earlier in the prompt or the
output and copying what followed them there (Saxena's prompt lookup decoding; llama.cpp's and vLLM's n-gram
speculation). It needs no second model and pays off on input-grounded work: summaries, edits, code, extraction.
A user's predicted output (OpenAI's Predicted Outputs) is a second such source, followed in order (Prediction).

Drafts are pure functions of the tokens, so they are the same on every rank and in every batch.
"""

import bisect
from typing import Dict, List, Sequence, Tuple

MAX_NGRAM, MIN_NGRAM = 3, 1
MAX_MATCH = 32  # how far back a match is followed to measure its length (the evidence a draft is a copy)


class NgramIndex:
    """For n = MIN_NGRAM..MAX_NGRAM, the latest place each n-gram of a growing token list occurs with a token after
    it; kept incrementally, so a draft costs a dictionary look-up per n rather than a scan of the text."""

    def __init__(self) -> None:
        self._last: Dict[Tuple[int, ...], int] = {}  # n-gram -> index of the token that followed its latest occurrence
        self._seen = 0  # tokens[:_seen] are indexed (each as the token following an n-gram)
        self.matched = 0  # how many tokens before the last draft agree with those before its source (<= MAX_MATCH)

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
        when none occurred before. Sets matched: the match followed back past its n-gram, so a draft that continues
        a long copy (an echo, an edit) is told from a chance match of a token or two."""
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
                m, end = n, len(tokens)
                while m < MAX_MATCH and at - 1 - m >= 0 and tokens[at - 1 - m] == tokens[end - 1 - m]:
                    m += 1
                self.matched = m
                return out
        return []


class Prediction:
    """A predicted output's tokens as a draft source, read in order: the first draft is its start; later ones
    continue after the occurrence of the output's last n tokens (n = MAX_NGRAM down to MIN_NGRAM) nearest at or
    after where the previous draft came from, so a prediction with repeated lines is followed line by line."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self._at: Dict[Tuple[int, ...], List[int]] = {}  # n-gram -> indices of the tokens following it, ascending
        for end in range(1, len(self.tokens)):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self._at.setdefault(tuple(self.tokens[end - n : end]), []).append(end)
        self.cursor = 0  # where the last draft was taken from

    def draft(self, generated: Sequence[int], k: int) -> List[int]:
        if k <= 0:
            return []
        if not generated:
            return self.tokens[:k]
        for n in range(min(MAX_NGRAM, len(generated)), MIN_NGRAM - 1, -1):
            at = self._at.get(tuple(generated[len(generated) - n :]))
            if at:
                i = bisect.bisect_left(at, self.cursor)
                self.cursor = at[i] if i < len(at) else at[-1]
                return self.tokens[self.cursor : self.cursor + k]
        return []
