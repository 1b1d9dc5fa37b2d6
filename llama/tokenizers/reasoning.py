"""A reasoning model's `<think>...</think>` block, split from its reply: the server returns it as
`reasoning_content` (vLLM's and llama.cpp's field), the Python API on request (chat_completion(...,
split_reasoning=True)).

A model reasons when its chat template knows `</think>` (DeepSeek-R1 and its distills, Qwen3, QwQ). The reply
starts inside the block when the rendered prompt ends with `<think>` (DeepSeek-R1's template opens it in the
generation prompt; a `<think>` the reply then writes first is skipped); else a block counts only at the very
start of the reply. What follows `</think>` is the content. Whitespace around the reasoning and before the
content is dropped (the templates put newlines there). A block never closed (the reply ran out of tokens) is all
reasoning. The split is the same whether the text arrives whole or in deltas: the deltas' concatenation equals
the whole split, whatever the cut points.
"""

from typing import List, Optional, Tuple

OPEN, CLOSE = "<think>", "</think>"


def is_reasoning_template(template: Optional[str]) -> bool:
    return bool(template) and CLOSE in template


def reasons(formatter) -> bool:
    """Whether a chat format renders a reasoning model's Jinja template (the tokenizer's, knowing </think>)."""
    return hasattr(formatter, "render") and is_reasoning_template(
        getattr(getattr(formatter, "tokenizer", None), "chat_template", None))


def prompt_opens_think(tokenizer, prompt: List[int]) -> bool:
    """Whether the prompt ends inside an open think block (its last `<think>` is not closed)."""
    tail = tokenizer.decode(list(prompt[-16:]))
    return tail.rfind(OPEN) > tail.rfind(CLOSE)


def _held(text: str, tag: str) -> int:
    """How many trailing characters of text could begin `tag` (held back until the next delta decides)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split(text: str, in_think: bool = False, final: bool = True) -> Tuple[Optional[str], str]:
    """(reasoning or None, content) of a reply's text. Not final: the parts already certain, a prefix of
    the final split's parts whatever follows."""
    start, body = 0, text.lstrip()
    if body.startswith(OPEN):  # a block at the start (one the prompt opened may be opened again: skipped)
        start = len(text) - len(body) + len(OPEN)
    elif not final and OPEN.startswith(body):  # empty, whitespace or a partial "<think": undecided
        return ("" if in_think else None), ""
    elif not in_think:
        return None, text
    close = text.find(CLOSE, start)
    if close < 0:
        thought = text[start:]
        if not final:
            thought = thought[:len(thought) - _held(thought, CLOSE)]
        return thought.strip() if final else thought.lstrip().rstrip(), ""
    return text[start:close].strip(), text[close + len(CLOSE):].lstrip()


class ReasoningStream:
    """Text deltas in, (reasoning delta, content delta) out; see the module docstring."""

    def __init__(self, in_think: bool = False):
        self.in_think, self.text = in_think, ""
        self.sent = ("", "")  # reasoning and content sent so far

    def _emit(self, final: bool) -> Tuple[str, str]:
        thought, content = split(self.text, self.in_think, final)
        thought = thought or ""
        out = (thought[len(self.sent[0]):], content[len(self.sent[1]):])
        self.sent = (thought, content)
        return out

    def feed(self, delta: str) -> Tuple[str, str]:
        self.text += delta
        return self._emit(final=False)

    def finish(self) -> Tuple[str, str]:
        return self._emit(final=True)


def split_predictions(predictions: List[dict], in_think: List[bool]) -> None:
    """Move each chat prediction's think block to generation["reasoning_content"] (in place; a reply without
    one is left as it is)."""
    for pred, opened in zip(predictions, in_think):
        thought, content = split(pred["generation"]["content"], opened)
        if thought is not None:
            pred["generation"]["reasoning_content"], pred["generation"]["content"] = thought, content
