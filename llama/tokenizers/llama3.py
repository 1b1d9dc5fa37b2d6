"""Meta's Llama 3 tokenizer: tiktoken byte-level BPE over 128,000 ranks plus 256 special tokens.

The file is Meta's `tokenizer.model` for Llama 3.x: one `base64-token rank` per line (sentencepiece cannot read
it). Encoding splits text with Meta's regular expression, in chunks of at most 400,000 characters and runs of at
most 25,000 consecutive whitespace or non-whitespace characters (tiktoken's regex would otherwise recurse deeply
on such runs), and treats special-token text inside the input as plain text: only the chat format inserts
special tokens, by id.
"""

import base64
from pathlib import Path
from typing import AbstractSet, Collection, Dict, Iterator, List, Literal, Optional, Union

import tiktoken

PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL = 256
NAMED_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>"]
# The family's stop tokens and the finish_reason each gives: end of text, end of turn, end of message (a built-in
# tool call the caller runs before the dialog continues). Also applied to a Llama 3 tokenizer.json (tokenizer_hf).
STOP_REASONS = {"<|end_of_text|>": "eos", "<|eot_id|>": "eot", "<|eom_id|>": "eom"}
MAX_CHARS = 400_000  # characters encoded per call
MAX_RUN = 25_000  # consecutive whitespace or non-whitespace characters per piece


def is_rank_file(path) -> bool:
    """Whether a file looks like a tiktoken rank file (`base64 rank` lines), from its first line."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096).split()
        return len(first) == 2 and first[1].isdigit() and len(base64.b64decode(first[0], validate=True)) > 0
    except (OSError, ValueError):
        return False


def read_ranks(path) -> Dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise ValueError(f"{path}:{n} is not a `base64-token rank` line of a tiktoken BPE file") from None
    return ranks


def split_runs(text: str, limit: int = MAX_RUN) -> Iterator[str]:
    """Pieces of text, cut so that no piece holds more than `limit` consecutive characters of one kind
    (whitespace or not); a cut falls only inside such a run."""
    start, run, kind = 0, 0, None
    for i, ch in enumerate(text):
        space = ch.isspace()
        if space is kind:
            run += 1
            if run > limit:
                yield text[start:i]
                start, run = i, 1
        else:
            kind, run = space, 1
    yield text[start:]


class TiktokenTokenizer:
    """What Meta's tiktoken tokenizers share (Llama 3 here, Llama 4 in llama4.py): encoding in Meta's chunks and
    runs, special-token text as plain text unless allowed, decoding. A subclass sets self.model (a
    tiktoken.Encoding), bos_id and eos_id."""

    _split_whitespaces_or_nonwhitespaces = staticmethod(split_runs)  # Meta's name, for code that calls it
    model: tiktoken.Encoding
    bos_id: int
    eos_id: int

    def encode(self, s: str, bos: bool, eos: bool,
               allowed_special: Union[Literal["all"], AbstractSet[str], None] = frozenset(),
               disallowed_special: Union[Literal["all"], Collection[str]] = ()) -> List[int]:
        """Ids of s. By default special-token text in s is encoded as plain text, never as the special id;
        allowed_special/disallowed_special are tiktoken's (Meta llama3's encode): "all" or a set of names (None:
        none, as llama4's default)."""
        if not isinstance(s, str):
            raise TypeError(f"encode expects a str, got {type(s).__name__}")
        allowed_special = frozenset() if allowed_special is None else allowed_special
        ids: List[int] = [self.bos_id] if bos else []
        for i in range(0, len(s), MAX_CHARS):
            for piece in split_runs(s[i : i + MAX_CHARS]):
                ids += self.model.encode(piece, allowed_special=allowed_special, disallowed_special=disallowed_special)
        return ids + [self.eos_id] if eos else ids

    def decode(self, t: List[int]) -> str:
        return self.model.decode(list(t))

    def piece(self, token_id: int) -> str:
        return self.model.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")


class Llama3Tokenizer(TiktokenTokenizer):
    """The Llama 3.x tokenizer, with the interface of llama.tokenizers.sentencepiece.Tokenizer and Meta llama3's."""

    num_reserved_special_tokens = NUM_SPECIAL
    pat_str = PATTERN

    def __init__(self, model_path, ranks: Optional[Dict[bytes, int]] = None):
        """ranks: the file's ranks when the caller has read them already (read_ranks)."""
        ranks = read_ranks(model_path) if ranks is None else ranks
        n_base = len(ranks)
        names = NAMED_SPECIAL + [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + NUM_SPECIAL - len(NAMED_SPECIAL))]
        self.special_tokens = {name: n_base + i for i, name in enumerate(names)}
        self.model = tiktoken.Encoding(name=Path(model_path).name, pat_str=PATTERN, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.n_words: int = self.model.n_vocab
        self.bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int = self.special_tokens["<|end_of_text|>"]
        self.pad_id: int = -1
        self.eot_id: int = self.special_tokens["<|eot_id|>"]
        self.eom_id: int = self.special_tokens["<|eom_id|>"]
        self.python_tag_id: int = self.special_tokens["<|python_tag|>"]
        self.stop_tokens: Dict[int, str] = {self.special_tokens[t]: reason for t, reason in STOP_REASONS.items()}
