"""A GGUF holding only a tokenizer, written from a Hugging Face tokenizer.json the way llama.cpp's
convert_hf_to_gguf.py writes one (get_vocab_base and gguf's SpecialVocab): tokens in id order; added tokens
CONTROL when special, USER_DEFINED (in plain text) otherwise; merges as "a b"; the pre-tokenizer name; BOS/EOS,
the add-BOS rule and the chat template. Tests load it with from_gguf and compare with transformers on the same
vocabulary."""

import json
from pathlib import Path
from typing import Optional

import gguf
from tokenizers import Tokenizer


def write_vocab_gguf(path: Path, tok: Tokenizer, pre: Optional[str], bos: Optional[str], eos: str,
                     add_bos: Optional[bool] = None, chat_template: Optional[str] = None) -> Path:
    spec = json.loads(tok.to_str())
    vocab, added = tok.get_vocab(with_added_tokens=True), tok.get_added_tokens_decoder()
    size = max(vocab.values()) + 1
    tokens, types = [f"[PAD{i}]" for i in range(size)], [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for i, a in added.items():
        if a.special:
            types[i] = gguf.TokenType.CONTROL
        else:  # convert_hf_to_gguf.py stores a non-normalized added token as the text it decodes to
            tokens[i] = tok.decode([i]) if not a.normalized else a.content
            types[i] = gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(vocab[bos])
    w.add_eos_token_id(vocab[eos])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_files() -> Path:
    """llama.cpp's tree (from llama-cpp-python's sdist, unpacked by `python tests/peers.py` at install) holding
    its tokenizer test vocabularies (models/ggml-vocab-*.gguf with .inp texts and the .out ids transformers gave
    them), the chat templates it tests (models/templates/) and src/llama-vocab.cpp."""
    import peers

    return peers.llama_cpp_tree()
