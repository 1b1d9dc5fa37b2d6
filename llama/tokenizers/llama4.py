"""Meta's Llama 4 tokenizer: tiktoken byte-level BPE over 200,000 ranks plus 2,048 special tokens (o200k's split
pattern), and `rank_file_tokenizer`, which tells a Llama 4 rank file from a Llama 3 one by its number of ranks.

Encoding is Llama 3's (llama3.TiktokenTokenizer: Meta's 400,000-character chunks and 25,000-character runs,
special-token text as plain text unless allowed). The special tokens follow the base ranks in Meta's order: the
basic five, the text post-training ones (<|header_start|> 200005, <|header_end|>, <|eom|>, <|eot|>, ...,
<|python_start|>, <|python_end|>, <|finetune_right_pad|>), the vision ones (<|image_start|> 200080, ...,
<|image|>, <|patch|>), the reasoning ones, then <|reserved_special_token_i|> up to 2,048.
"""

from pathlib import Path
from typing import Dict, List, Optional

import tiktoken

from llama.tokenizers.llama3 import Llama3Tokenizer, TiktokenTokenizer, read_ranks

PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
NUM_BASE = 200_000  # ranks of Llama 4's file (Llama 3's has 128,000)
NUM_SPECIAL = 2048
# A tool result's and a tool-calling reply's end is <|eom|>, a turn's <|eot|>: both stop a generation.
STOP_REASONS = {"<|end_of_text|>": "eos", "<|eot|>": "eot", "<|eom|>": "eom"}


def reserved(name: str, count: int, start: int = 0) -> List[str]:
    """<|{name}_reserved_special_token_{i}|> for i in start .. start + count - 1."""
    return [f"<|{name}_reserved_special_token_{i}|>" for i in range(start, start + count)]


BASIC_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]
TEXT_POST_TRAIN = (["<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>"]
                   + reserved("text_post_train", 6)
                   + ["<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>"]
                   + reserved("text_post_train", 61, 8))
VISION = (["<|image_start|>", "<|image_end|>"] + reserved("vision", 2) + ["<|tile_x_separator|>",
          "<|tile_y_separator|>"] + reserved("vision", 4, 2) + ["<|image|>"] + reserved("vision", 1, 6)
          + ["<|patch|>"] + reserved("vision", 1041, 7))
REASONING = reserved("reasoning", 8) + ["<|reasoning_thinking_start|>", "<|reasoning_thinking_end|>"]
LLAMA4_SPECIAL_TOKENS = TEXT_POST_TRAIN + VISION + REASONING
IMAGE_TOKENS = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                "<|tile_y_separator|>")


def special_token_names() -> List[str]:
    named = BASIC_SPECIAL_TOKENS + LLAMA4_SPECIAL_TOKENS
    return named + [f"<|reserved_special_token_{i}|>" for i in range(NUM_SPECIAL - len(named))]


class Llama4Tokenizer(TiktokenTokenizer):
    """The Llama 4 tokenizer, with this package's tokenizer interface (stop_tokens maps id -> finish reason,
    piece) and llama-models' llama4 one (special_tokens, model, n_words, pad_id, eot_id, eom_id, thinking ids)."""

    num_reserved_special_tokens = NUM_SPECIAL
    pat_str = O200K_PATTERN = PATTERN

    def __init__(self, model_path, ranks: Optional[Dict[bytes, int]] = None):
        """ranks: the file's ranks when the caller has read them already (read_ranks)."""
        ranks = read_ranks(model_path) if ranks is None else ranks
        n_base = len(ranks)
        self.special_tokens = {name: n_base + i for i, name in enumerate(special_token_names())}
        self.model = tiktoken.Encoding(name=Path(model_path).name, pat_str=PATTERN, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.n_words: int = self.model.n_vocab
        special = self.special_tokens
        self.bos_id: int = special["<|begin_of_text|>"]
        self.eos_id: int = special["<|end_of_text|>"]
        self.pad_id: int = special["<|finetune_right_pad|>"]
        self.eot_id: int = special["<|eot|>"]
        self.eom_id: int = special["<|eom|>"]
        self.thinking_start_id: int = special["<|reasoning_thinking_start|>"]
        self.thinking_end_id: int = special["<|reasoning_thinking_end|>"]
        self.stop_tokens: Dict[int, str] = {special[t]: reason for t, reason in STOP_REASONS.items()}


def rank_file_tokenizer(path):
    """The tokenizer of a tiktoken rank file: Llama 4's for a file of 200,000 ranks, else Llama 3's."""
    ranks = read_ranks(path)
    if len(ranks) == NUM_BASE:
        return Llama4Tokenizer(path, ranks)
    return Llama3Tokenizer(path, ranks)
