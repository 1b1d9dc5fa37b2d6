"""The tokenizer and the Llama 2 chat template, checked on the real Llama 2 tokenizer."""

import pytest

from llama.tokenizers.chat_format import ChatFormat
from llama.tokenizers.sentencepiece import Tokenizer


@pytest.fixture(scope="module")
def tok(llama2_tokenizer_path):
    return Tokenizer(str(llama2_tokenizer_path))


def test_llama2_tokenizer_basics(tok):
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (32000, 1, 2, -1)
    ids = tok.encode("Hello world", bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(tok.encode("héllo 你好 🦙", bos=False, eos=False)) == "héllo 你好 🦙"


def test_system_and_user_dialog(tok):
    dialog = [{"role": "system", "content": "  Always answer with Haiku "},
              {"role": "user", "content": "I am going to Paris, what should I see?\n"}]
    expected = [tok.bos_id] + tok.sp_model.encode(
        "[INST] <<SYS>>\n  Always answer with Haiku \n<</SYS>>\n\nI am going to Paris, what should I see? [/INST]")
    assert ChatFormat(tok).encode_dialog_prompt(dialog) == expected
    # The system text is folded into the first user message before stripping, exactly as the reference does.
    assert tok.decode(expected).startswith("[INST] <<SYS>>\n  Always")


def test_user_assistant_user_dialog(tok):
    dialog = [{"role": "user", "content": "Hi there"},
              {"role": "assistant", "content": " Hello! How can I help? "},
              {"role": "user", "content": "Tell me a joke."}]
    sp = tok.sp_model
    expected = ([1] + sp.encode("[INST] Hi there [/INST] Hello! How can I help? ") + [2]
                + [1] + sp.encode("[INST] Tell me a joke. [/INST]"))
    assert ChatFormat(tok).encode_dialog_prompt(dialog) == expected
    assert expected.count(1) == 2 and expected.count(2) == 1


@pytest.mark.parametrize("dialog, message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "assistant", "content": "hi"}], "expected role 'user'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "expected role 'assistant'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last message must be from the user"),
    ([{"role": "robot", "content": "a"}], "unknown role 'robot'"),
    ([{"role": "system", "content": "a"}], "must be followed by a user message"),
    ([{"role": "user"}], "'role' and 'content'"),
    ([{"role": "user", "content": 3}], "content must be a str"),
    ([{"role": "system", "content": "s"}, {"role": "system", "content": "t"}, {"role": "user", "content": "u"}],
     "expected role 'user'"),
])
def test_malformed_dialogs(tok, dialog, message):
    with pytest.raises(ValueError, match=message):
        ChatFormat(tok).encode_dialog_prompt(dialog)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer(str(tmp_path / "missing.model"))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a valid sentencepiece model"):
        Tokenizer(str(bad))
