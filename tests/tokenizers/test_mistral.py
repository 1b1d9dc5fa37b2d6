"""Mistral's tokenizers and prompt format against mistral-common, their authority: Mistral Nemo's tekken
tokenizer (as mistral-common ships it, converted by transformers and written as a GGUF with pre 'tekken' the way
convert_hf_to_gguf.py writes it) with Nemo's real chat template gives mistral-common's encode_chat_completion ids
token for token; the sentencepiece tokenizer of Mistral 7B v0.1 that mistral-common ships loads with our loader
and encodes to its ids."""

import os
import warnings
from pathlib import Path

import peers
import pytest
from test_pretokenizers import TEXTS
from vocab_gguf import write_vocab_gguf

from llama.formats.gguf_file import open_reader
from llama.tokenizers import huggingface as tokenizer_hf
from llama.tokenizers.chat_format import TemplateChatFormat, chat_format_for

mistral_common = pytest.importorskip("mistral_common", reason="pip install mistral-common (the test extra)")
DATA = Path(os.path.dirname(mistral_common.__file__)) / "data"
DIALOGS = [
    [{"role": "user", "content": "What is 12345 + 1?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 12345 + 1?"},
     {"role": "assistant", "content": "12346"}, {"role": "user", "content": "And  times 2? Answer in 中文."}],
]


def request(dialog):
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    return ChatCompletionRequest(messages=[kinds[m["role"]](content=m["content"]) for m in dialog])


def test_nemo_tekken_gguf_and_template_give_mistral_common_ids(tmp_path):
    pytest.importorskip("transformers")
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers.integrations.mistral import convert_tekken_tokenizer

    source = DATA / "tekken_240718.json"
    authority = MistralTokenizer.from_file(str(source))
    hf = convert_tekken_tokenizer(str(source)).backend_tokenizer
    path = write_vocab_gguf(tmp_path / "nemo.gguf", hf, "tekken", "<s>", "</s>", add_bos=True,
                            chat_template=peers.template("mistralai-Mistral-Nemo-Instruct-2407.jinja"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = tokenizer_hf.from_gguf(open_reader(path), path)
    raw = authority.instruct_tokenizer.tokenizer
    for text in TEXTS:
        assert tok.encode(text, bos=False, eos=False) == raw.encode(text, bos=False, eos=False), text
    fmt = chat_format_for(tok)
    assert isinstance(fmt, TemplateChatFormat)
    for dialog in DIALOGS:
        assert fmt.encode_dialog_prompt(dialog) == authority.encode_chat_completion(request(dialog)).tokens


def test_mistral_7b_sentencepiece_tokenizer_loads_and_encodes_as_mistral_common():
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from llama.tokenizers.sentencepiece import load_tokenizer

    source = DATA / "tokenizer.model.v1"
    raw = MistralTokenizer.from_file(str(source)).instruct_tokenizer.tokenizer
    tok = load_tokenizer(source)
    assert (tok.bos_id, tok.eos_id) == (raw.bos_id, raw.eos_id)
    for text in TEXTS:
        assert tok.encode(text, bos=True, eos=False) == raw.encode(text, bos=True, eos=False), text
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == raw.decode(raw.encode(text, False, False))
