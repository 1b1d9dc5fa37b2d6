"""Incremental detokenization with stop strings, shared by streaming, batch completion and the engine.

SentencePiece drops the leading space of the first piece it decodes and spreads one character over several
byte-fallback pieces, so the text of new tokens is taken as a difference of two decodes over a short window
that starts inside the already-decoded text (vLLM's prefix/read offsets). A delta is released only when it does
not end in an incomplete UTF-8 character and cannot still turn into a stop string.
"""

from typing import List, Optional, Sequence

REPLACEMENT = "\ufffd"  # what a broken UTF-8 sequence decodes to


class TextStream:
    """Text of generated tokens, in deltas; `text` is always the concatenation of the deltas released so far
    plus the held-back tail, and equals decode(context + tokens) minus decode(context)."""

    def __init__(self, tokenizer, context: Sequence[int] = (), stop: Sequence[str] = (), strip_space: bool = False):
        self.tokenizer = tokenizer
        self.strip_space = strip_space  # drop one leading space (a chat reply: the template's separator)
        self.ids: List[int] = list(context[-4:])  # a few tokens of context keep the first piece's leading space
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.text = ""  # decoded text of the generated tokens so far (complete characters only)
        self.emitted = 0  # chars of self.text already released
        self.stopped_at: Optional[int] = None  # char index where a stop string begins
        self.ends: List[int] = []  # len(self.text) after each token, to map a stop back to tokens

    def add(self, token: int) -> str:
        """Feed one generated token; return the text that is now safe to release (possibly empty)."""
        if self.stopped_at is not None:
            return ""
        self.ids.append(token)
        self.ends.append(len(self.text))
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            old_len = len(self.text)
            self._append(new_text[len(prefix_text) :])
            # Tokens held for an incomplete character end with it; recorded before a stop truncates the text,
            # so the tokens that make up a stop string never count as before it.
            pending = len(self.ids) - self.read_offset
            self.ends[-pending:] = [len(self.text)] * pending
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._find_stop(old_len)
        return self._release()

    def finish(self) -> str:
        """Release everything left, including an incomplete trailing character."""
        if self.stopped_at is None and self.read_offset < len(self.ids):
            prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
            new_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
            old_len = len(self.text)
            self._append(new_text[len(prefix_text) :])
            self.read_offset = len(self.ids)
            self._find_stop(old_len)
            if self.ends:
                self.ends[-1] = len(self.text)
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def tokens_before_stop(self) -> int:
        """How many generated tokens lie wholly before the stop string."""
        return sum(1 for end in self.ends if end <= self.stopped_at)

    def _append(self, new: str) -> None:
        if self.strip_space and new:
            self.strip_space = False
            new = new[1:] if new.startswith(" ") else new
        self.text += new

    def _find_stop(self, old_len: int) -> None:
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, old_len - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best = i
        if best is not None:
            self.stopped_at = best
            self.text = self.text[:best]

    def _release(self) -> str:
        end = len(self.text)
        if self.stopped_at is None:
            end -= self._held_back()
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest


class SilentStream:
    """The text stream of a request that runs without a tokenizer (the scheduler driven without a model, in tests
    and the pool's memory benchmark): no text, and it never stops a request."""

    stopped = False

    def add(self, token: int) -> str:
        return ""

    def finish(self) -> str:
        return ""
