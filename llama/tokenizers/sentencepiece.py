"""Tokenizers: Meta's SentencePiece model (Llama 2) here, tiktoken (Llama 3 and 4) in llama3.py and llama4.py,
and `load_tokenizer`, which picks the kind from the file.

Every tokenizer offers: n_words, bos_id, eos_id, pad_id, encode(s, bos, eos), decode(ids), piece(id), and
stop_tokens: {token id: finish_reason} for the tokens that end a generation (the stop token is not part of the
text). The decode core only uses this interface.
"""

import os
from typing import Dict, List, Optional

from sentencepiece import SentencePieceProcessor

from llama.tokenizers import huggingface
from llama.tokenizers.llama3 import is_rank_file
from llama.tokenizers.llama4 import rank_file_tokenizer
from llama.tokenizers.text import check_text


def _check_path(model_path) -> str:
    if not isinstance(model_path, (str, os.PathLike)):
        raise TypeError(f"tokenizer path must be a str or path, got {type(model_path).__name__}")
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"tokenizer model {str(model_path)!r} not found")
    return str(model_path)


class Tokenizer:
    """Meta's SentencePiece tokenizer (Llama 2). Meta's `llama.tokenizer.Tokenizer(path)` also names Llama 3's
    tokenizer, so given a tiktoken file it returns a Llama3Tokenizer (Meta llama3's interface), or a
    Llama4Tokenizer for Llama 4's (llama-models' llama4 interface)."""

    def __new__(cls, model_path: Optional[str] = None):  # None: copy and pickle make the object without arguments
        if cls is Tokenizer and model_path is not None and is_rank_file(_check_path(model_path)):
            return rank_file_tokenizer(model_path)
        return super().__new__(cls)

    def __init__(self, model_path: str):
        model_path = _check_path(model_path)
        try:
            self.sp_model = SentencePieceProcessor(model_file=model_path)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{model_path} is not a valid sentencepiece model: {e}") from None
        self.n_words: int = self.sp_model.vocab_size()
        self.bos_id: int = self.sp_model.bos_id()
        self.eos_id: int = self.sp_model.eos_id()
        self.pad_id: int = self.sp_model.pad_id()
        self.stop_tokens: Dict[int, str] = {self.eos_id: "eos"}
        if self.sp_model.vocab_size() != self.sp_model.get_piece_size():
            raise ValueError(f"{model_path}: inconsistent vocabulary size")

    def encode(self, s: str, bos: bool, eos: bool) -> List[int]:
        if not isinstance(s, str):
            raise TypeError(f"encode expects a str, got {type(s).__name__}")
        t = self.sp_model.encode(check_text("text", s))
        if bos:
            t = [self.bos_id] + t
        if eos:
            t = t + [self.eos_id]
        return t

    def decode(self, t: List[int]) -> str:
        return self.sp_model.decode(list(t))

    def piece(self, token_id: int) -> str:
        return self.sp_model.id_to_piece(token_id)


def load_tokenizer(path):
    """The tokenizer stored in `path`, of whichever kind the file is: Meta's sentencepiece model (Llama 2), tiktoken
    rank file (Llama 3 or 4, by its number of ranks) or Hugging Face tokenizer.json. No flag: the file says which."""
    path = _check_path(path)
    if is_rank_file(path):
        return rank_file_tokenizer(path)
    if path.endswith(".json"):
        return huggingface.from_tokenizer_json(path)
    try:
        return Tokenizer(path)
    except ValueError:
        raise ValueError(f"{path} is neither a sentencepiece model (Llama 2) nor a tiktoken BPE rank file "
                         "(Llama 3 or 4)") from None
