"""Tokenizers as Hugging Face builds them (the `tokenizers` package): from a GGUF file's embedded vocabulary —
byte-level BPE with merges ('gpt2': SmolLM, Llama 3 on Hugging Face, Qwen...), split first by the pre-tokenizer
the file names (tokenizer.ggml.pre, llama/tokenizers/pretokenizers.py), or a sentencepiece vocabulary with scores
('llama': Llama 2, TinyLlama, Mistral...) — or from a tokenizer.json.

Control tokens of the vocabulary become special tokens, so a chat template's `<|im_start|>` text encodes to its id.
The file's add-BOS rule is kept: `encode(s, bos=True)` adds BOS only where the model was trained with one.
"""

import json
from pathlib import Path
from typing import Dict, List, Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from llama.tokenizers import pretokenizers
from llama.tokenizers.llama3 import STOP_REASONS
from llama.tokenizers.llama4 import STOP_REASONS as LLAMA4_STOPS
from llama.tokenizers.text import check_text

CONTROL, UNKNOWN, USER_DEFINED = 3, 2, 4  # llama.cpp's token types: control (special), unknown, user-defined
SPACE = "\u2581"  # sentencepiece's visible space


class HFTokenizer:
    """The interface of llama.tokenizers.sentencepiece.Tokenizer over a `tokenizers.Tokenizer`."""

    def __init__(self, tok: Tokenizer, bos_id: int, eos_id: int, add_bos: bool, chat_template: Optional[str] = None,
                 source: str = ""):
        self.tok, self.source = tok, source
        self.n_words: int = tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id, self.add_bos = bos_id, eos_id, -1, add_bos
        self.chat_template = chat_template
        self.stop_tokens: Dict[int, str] = {eos_id: "eos"}
        self.special_ids = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        family = (STOP_REASONS if "<|start_header_id|>" in self.special_ids  # Llama 3's or 4's vocabulary: stop
                  else LLAMA4_STOPS if "<|header_start|>" in self.special_ids else {})  # on each of the family's stops
        self.stop_tokens.update({self.special_ids[t]: reason for t, reason in family.items() if t in self.special_ids})

    def encode(self, s: str, bos: bool, eos: bool) -> List[int]:
        if not isinstance(s, str):
            raise TypeError(f"encode expects a str, got {type(s).__name__}")
        ids = self.tok.encode(check_text("text", s), add_special_tokens=False).ids
        if bos and self.add_bos:
            ids = [self.bos_id] + ids
        return ids + [self.eos_id] if eos else ids

    def decode(self, t: List[int]) -> str:
        return self.tok.decode(list(t), skip_special_tokens=False)

    def piece(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id)


def from_gguf(reader, path: Path) -> HFTokenizer:
    """The tokenizer embedded in a GGUF file, with its BOS/EOS, add-BOS rule and chat template."""
    f = reader.fields
    kind = f["tokenizer.ggml.model"].contents() if "tokenizer.ggml.model" in f else None
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{path}: embedded tokenizer model {kind!r} is not supported (only 'gpt2', byte-level BPE, "
                         "and 'llama', sentencepiece): pass tokenizer_path")
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in f else [1] * len(tokens)
    get = lambda key, default: f[key].contents() if key in f else default  # noqa: E731
    if kind == "gpt2":
        pre = pretokenizers.for_gguf(get("tokenizer.ggml.pre", None), str(path))
        tok = _byte_level_bpe(tokens, get("tokenizer.ggml.merges", []), pre)
        add_bos_default = pre.add_bos
    else:
        if "tokenizer.ggml.scores" not in f:
            raise ValueError(f"{path}: a 'llama' vocabulary needs tokenizer.ggml.scores, which the file lacks")
        tok = _sentencepiece_bpe(tokens, f["tokenizer.ggml.scores"].contents(), types,
                                 get("tokenizer.ggml.unknown_token_id", None))
        add_bos_default = True  # sentencepiece models add BOS unless the file says otherwise
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    # A tokenizer.json's added tokens that are not special (Qwen's <tool_call>, DeepSeek-R1's <think>) are stored
    # as user-defined, in plain text: matched whole in the text before BPE, as llama.cpp and Hugging Face do.
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return HFTokenizer(tok, int(get("tokenizer.ggml.bos_token_id", 1)), int(get("tokenizer.ggml.eos_token_id", 2)),
                       bool(get("tokenizer.ggml.add_bos_token", add_bos_default)),
                       get("tokenizer.chat_template", None), str(path))


def _byte_level_bpe(tokens: List[str], merges: List[str], pre: pretokenizers.PreTokenizer) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre.build()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: List[str], scores: List[float], types: List[int], unk_id: Optional[int]) -> Tokenizer:
    """A sentencepiece BPE vocabulary as Hugging Face's Llama converter builds it: merges ranked by the merged
    piece's score, byte fallback for characters outside the vocabulary, a dummy-prefix space."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores))
    merges = []
    for piece, i in vocab.items():
        if types[i] != 1:  # only normal pieces are merge results; bytes, controls and unknown are not
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-score[piece], vocab[left], vocab[right], left, right))
    merges.sort()
    if unk_id is None:
        unk_id = next((i for i, ty in enumerate(types) if ty == UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], fuse_unk=True, byte_fallback=True,
                               unk_token=tokens[unk_id] if unk_id is not None else None))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def from_tokenizer_json(path) -> HFTokenizer:
    """A tokenizer.json, with BOS/EOS, the add-BOS rule and the chat template from tokenizer_config.json beside it."""
    path = Path(path)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a plain Exception for a bad file
        raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from None
    config_path = path.with_name("tokenizer_config.json")
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    text = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
    bos, eos = text(config.get("bos_token")), text(config.get("eos_token"))
    bos_id = tok.token_to_id(bos) if bos else None
    eos_id = tok.token_to_id(eos) if eos else None
    if eos_id is None:
        raise ValueError(f"{config_path} names no eos_token that {path} knows: it is needed to stop generation")
    add_bos = bool(config.get("add_bos_token", False)) and bos_id is not None
    return HFTokenizer(tok, bos_id if bos_id is not None else -1, eos_id, add_bos, config.get("chat_template"),
                       str(path))
