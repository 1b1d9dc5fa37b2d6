"""Meta's own Llama 3 tokenizer tests, run from the installed llama-models package (its
llama_models/llama3/tests/api/test_tokenizer.py) against Meta's module path `llama.tokenizer`: the test's
`Tokenizer` and `ChatFormat` names are pointed at ours, on Meta's Llama 3 tokenizer file from ../shared.

llama-models' test is written for its newer API (RawMessage, a tool prompt format, encode_message returning
(tokens, images), encode_dialog_prompt returning an object with .tokens); the adapters below only translate
those shapes into Meta llama3's (dict messages, token lists), so every token id asserted is Meta's and every id
compared is produced by `llama.tokenizer`."""

from types import SimpleNamespace

import pytest
from conftest import SHARED, need

from llama import tokenizer as ours

meta_tests = pytest.importorskip("llama_models.llama3.tests.api.test_tokenizer",
                                 reason="llama-models (Meta's reference code, the test extra) holds the test")

LLAMA3_TOKENIZER = SHARED / "tokenizers" / "llama3" / "tokenizer.model"


def _message(m) -> dict:
    return {"role": m.role, "content": m.content}


class _Tokenizer:
    @staticmethod
    def get_instance():
        return ours.Tokenizer(str(need(LLAMA3_TOKENIZER)))


class _ChatFormat:
    """llama-models' ChatFormat calls, answered by llama.tokenizer.ChatFormat."""

    def __init__(self, tokenizer):
        self.format = ours.ChatFormat(tokenizer)

    def encode_message(self, message, tool_prompt_format=None):
        return self.format.encode_message(_message(message)), []

    def encode_dialog_prompt(self, messages, tool_prompt_format=None):
        return SimpleNamespace(tokens=self.format.encode_dialog_prompt([_message(m) for m in messages]))


@pytest.fixture(autouse=True)
def pointed_at_llama_tokenizer(monkeypatch):
    monkeypatch.setattr(meta_tests, "Tokenizer", _Tokenizer)
    monkeypatch.setattr(meta_tests, "ChatFormat", _ChatFormat)


class TestMetaTokenizer(meta_tests.TokenizerTests):
    """Meta's TokenizerTests, unchanged, collected here."""


def test_meta_tests_ran_on_ours():
    """The adapters engaged: Meta's setUp builds our classes, not llama-models' own."""
    case = TestMetaTokenizer("test_encode")
    case.setUp()
    # what llama.tokenizer's Tokenizer(path) and ChatFormat(tokenizer) give for a Llama 3 file
    from llama.tokenizers.chat_format import Llama3ChatFormat
    from llama.tokenizers.llama3 import Llama3Tokenizer

    assert isinstance(case.tokenizer, Llama3Tokenizer) and isinstance(case.format.format, Llama3ChatFormat)
    names = [n for n in dir(meta_tests.TokenizerTests) if n.startswith("test_")]
    assert set(names) >= {"test_special_tokens", "test_encode", "test_decode", "test_encode_message",
                          "test_encode_dialog"}
