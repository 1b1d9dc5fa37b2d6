"""Mistral's tokenizers and prompt format against mistral-common, their authority: Mistral Nemo's tekken
tokenizer (as mistral-common ships it, converted by transformers and written as a GGUF with pre 'tekken' the way
convert_hf_to_gguf.py writes it) with Nemo's real chat template gives mistral-common's encode_chat_completion ids
token for token, tool dialogs too (whose markers are single tokens in this vocabulary); the sentencepiece
tokenizer of Mistral 7B v0.1 that mistral-common ships loads with our loader and encodes to its ids."""

import json
import os
import warnings
from pathlib import Path

import peers
import pytest
from test_pretokenizers import TEXTS
from test_tool_format import WEATHER, dialog
from test_tool_vocab import reply_text
from vocab_gguf import write_vocab_gguf

from llama.formats.gguf_file import open_reader
from llama.tokenizers import huggingface
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


@pytest.fixture(scope="module")
def nemo(tmp_path_factory):
    """(our tokenizer from Nemo's tekken GGUF with its template, mistral-common's MistralTokenizer)."""
    pytest.importorskip("transformers")
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers.integrations.mistral import convert_tekken_tokenizer

    source = DATA / "tekken_240718.json"
    hf = convert_tekken_tokenizer(str(source)).backend_tokenizer
    path = write_vocab_gguf(tmp_path_factory.mktemp("nemo") / "nemo.gguf", hf, "tekken", "<s>", "</s>", add_bos=True,
                            chat_template=peers.template("mistralai-Mistral-Nemo-Instruct-2407.jinja"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return huggingface.from_gguf(open_reader(path), path), MistralTokenizer.from_file(str(source))


def test_nemo_tekken_gguf_and_template_give_mistral_common_ids(nemo):
    tok, authority = nemo
    raw = authority.instruct_tokenizer.tokenizer
    for text in TEXTS:
        assert tok.encode(text, bos=False, eos=False) == raw.encode(text, bos=False, eos=False), text
    fmt = chat_format_for(tok)
    assert isinstance(fmt, TemplateChatFormat)
    for turns in DIALOGS:
        assert fmt.encode_dialog_prompt(turns) == authority.encode_chat_completion(request(turns)).tokens


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


def tool_request(dialog, tools):
    """The dialog (ours, arguments as objects) as mistral-common's request with tools."""
    from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall

    def message(m):
        if m["role"] == "tool":
            return ToolMessage(content=m["content"], tool_call_id=m["tool_call_id"])
        if m["role"] == "user":
            return UserMessage(content=m["content"])
        calls = [ToolCall(id=c["id"], function=FunctionCall(name=c["name"], arguments=json.dumps(c["arguments"])))
                 for c in m.get("tool_calls", [])]
        return AssistantMessage(content=m["content"] or None, tool_calls=calls or None)

    return ChatCompletionRequest(messages=[message(m) for m in dialog],
                                 tools=[Tool(function=Function(**t["function"])) for t in tools])


def test_nemo_tool_dialog_gives_mistral_common_ids_with_single_marker_tokens(nemo):
    """In Mistral's own vocabulary [TOOL_CALLS], [AVAILABLE_TOOLS] and [TOOL_RESULTS] (and their ends) are one
    control token each: a tool dialog (two calls, their results) through Nemo's template is mistral-common's
    encode_chat_completion(tools=...) token for token, the call grammar writes [TOOL_CALLS] as its token, and a
    call generated after it parses back."""
    from llama.sample.tool_grammar import calls_lark, special_ids
    from llama.tokenizers.tool_format import ToolDialog, family_of, parse

    tok, authority = nemo
    fmt = chat_format_for(tok)
    msgs = dialog(2, ("abcdefghi", "ABCDEFGH1"))[1:]  # Nemo's template takes no system message before tools
    ids = fmt.encode_dialog_prompt(ToolDialog(msgs, [WEATHER], family_of(fmt)))
    assert family_of(fmt) == "mistral" and ids == authority.encode_chat_completion(tool_request(msgs, [WEATHER])).tokens
    markers = {m: special_ids(tok)[m] for m in ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                               "[TOOL_RESULTS]", "[/TOOL_RESULTS]")}
    raw = authority.instruct_tokenizer.tokenizer
    special = getattr(raw, "get_special_token", None) or raw.get_control_token  # the older name
    assert markers == {m: special(m) for m in markers}
    assert [ids.count(i) for i in markers.values()] == [1, 1, 1, 2, 2]
    assert f"<[{markers['[TOOL_CALLS]']}]>" in calls_lark("mistral", [WEATHER["function"]], False, special_ids(tok))
    call = {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}
    reply = [markers["[TOOL_CALLS]"]] + tok.encode(json.dumps([call]), bos=False, eos=False)
    assert parse("mistral", reply_text(tok, ids, reply)) == (None, [("get_weather", call["arguments"])])
