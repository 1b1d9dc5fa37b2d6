"""Llama 4's tokenizer and chat format against llama-models' llama4 Tokenizer and ChatFormat (Meta's reference, a
test dependency, whose tokenizer.model the tests read): ids on varied text, dialogs with tool turns and tool calls
token for token (the tool-system text taken from llama-models' own prompt-format document), replies decoded into
the same calls, image content refused, and llama-models' module paths (llama.llama4.tokenizer, .chat_format)."""

import json
from pathlib import Path

import pytest

from llama.tokenizers.chat_format import ChatFormat, chat_format_for
from llama.tokenizers.llama4 import Llama4Tokenizer
from llama.tokenizers.llama4_chat import Llama4ChatFormat
from llama.tokenizers.sentencepiece import load_tokenizer
from llama.tokenizers.tool_format import ToolDialog, meta_system_text, meta_tools_message, parse

llama_models = pytest.importorskip("llama_models", reason="llama-models (Meta's reference code) is a test dependency")


def _without_torchvision():
    """llama-models' llama4 chat_format imports its image transforms (torchvision) at module level but uses them
    only with vision_args; without torchvision, a stand-in module lets the text path import (in this process)."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("torchvision") is None and "llama_models.llama4.preprocess" not in sys.modules:
        stub = types.ModuleType("llama_models.llama4.preprocess")
        stub.ResizeNormalizeImageTransform = stub.VariableSizeImageTransform = None
        sys.modules["llama_models.llama4.preprocess"] = stub


_without_torchvision()
from llama_models.datatypes import BuiltinTool, RawMessage, StopReason, ToolCall, ToolPromptFormat  # noqa: E402
from llama_models.llama4.chat_format import ChatFormat as MetaChatFormat  # noqa: E402
from llama_models.llama4.tokenizer import Tokenizer as MetaTokenizer  # noqa: E402

PATH = Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(PATH)


@pytest.fixture(scope="module")
def meta():
    tokenizer = MetaTokenizer(PATH)
    return tokenizer, MetaChatFormat(tokenizer)


# ------------------------------------------------------------------------------------------------- tokenizer
def test_the_file_is_told_from_llama3s_and_has_metas_special_tokens(tok, meta):
    assert isinstance(tok, Llama4Tokenizer)
    from llama.tokenizer import Tokenizer  # Meta's path takes the file too

    assert isinstance(Tokenizer(str(PATH)), Llama4Tokenizer)
    ref = meta[0]
    assert tok.special_tokens == ref.special_tokens and tok.n_words == ref.n_words == 202048
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.eot_id, tok.eom_id) == (ref.bos_id, ref.eos_id, ref.pad_id,
                                                                          ref.eot_id, ref.eom_id)
    assert (tok.thinking_start_id, tok.thinking_end_id) == (ref.thinking_start_id, ref.thinking_end_id)
    assert set(tok.stop_tokens) == set(ref.stop_tokens)
    assert tok.stop_tokens[tok.eot_id] == "eot" and tok.stop_tokens[tok.eom_id] == "eom"
    assert tok.special_tokens["<|header_start|>"] == 200005 and tok.special_tokens["<|image|>"] == 200090
    assert tok.pat_str == ref.O200K_PATTERN


VARIED = ["Hello, world!", "  leading and   inner   spaces\n\n\ttabs  ", "digits 1234567 and 3.14159e-10",
          "emoji 🦙🔥👍🏽 and flags 🇫🇷", "中文字符和日本語のテキスト、한국어", "def f(x):\n    return x ** 2  # code\n",
          "CamelCaseWords HTTPServer I'm you'LL path/to/file\r\n", "Ünïcödé çåsé\r\nwindows lines",
          "a literal <|eot|> and <|header_start|>user<|header_end|> and <|image|> in text", "x" * 30000,
          " " * 30001 + "end", "word " * 9000, ""]


@pytest.mark.parametrize("text", VARIED, ids=range(len(VARIED)))
def test_encode_and_decode_equal_metas(tok, meta, text):
    ref = meta[0]
    for kw in ({}, {"allowed_special": "all"}, {"allowed_special": {"<|eot|>"}}):
        ids = tok.encode(text, bos=True, eos=True, **kw)
        assert ids == ref.encode(text, bos=True, eos=True, **kw)
        assert tok.decode(ids) == ref.decode(ids)
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_special_token_text_is_plain_unless_allowed(tok):
    text = "say <|eot|> now"
    assert tok.eot_id not in tok.encode(text, bos=False, eos=False)
    assert tok.eot_id in tok.encode(text, bos=False, eos=False, allowed_special="all")
    with pytest.raises(ValueError, match="disallowed special token"):
        tok.encode(text, bos=False, eos=False, disallowed_special="all")
    assert tok.piece(tok.eot_id) == "<|eot|>"


def test_a_llama4_tokenizer_json_stops_on_every_stop_token(tmp_path):
    """A Hugging Face Llama 4 directory's tokenizer.json names one eos_token (<|eot|> for Instruct models): the
    family's other stops (<|end_of_text|>, <|eom|>) end a generation too."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>"]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                               "eos_token": "<|eot|>", "add_bos_token": True}))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    ids = {t: hf.token_to_id(t) for t in names}
    assert tok.stop_tokens == {ids["<|end_of_text|>"]: "eos", ids["<|eot|>"]: "eot", ids["<|eom|>"]: "eom"}


# ------------------------------------------------------------------------------------------------- chat format
def raw(m):
    """llama-models' RawMessage of one of our messages."""
    calls = [ToolCall(call_id=f"c{k}", tool_name=BuiltinTool[c["name"]] if c["name"] in BuiltinTool.__members__
                      else c["name"], arguments=c["arguments"]) for k, c in enumerate(m.get("tool_calls", []))]
    stop = StopReason.end_of_message if m.get("stop_reason") == "eom" else None
    role = "tool" if m["role"] in ("tool", "ipython") else m["role"]
    return RawMessage(role=role, content=m["content"], tool_calls=calls, stop_reason=stop)


PLAIN = [{"role": "system", "content": "Always answer with Haiku"}, {"role": "user", "content": " Hi there\n"},
         {"role": "assistant", "content": "Hello! <|eot|> How can I help?"}, {"role": "user", "content": "A joke."}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris, and 2+2?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "name": "get_weather",
                                                         "arguments": {"city": "Paris", "days": 3}}]},
    {"role": "tool", "content": json.dumps({"forecast": "sunny"}), "tool_call_id": "a"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "s", "name": "brave_search",
                                                         "arguments": {"query": "Oslo weather"}}]},
    {"role": "ipython", "content": "rain", "tool_call_id": "s"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "name": "code_interpreter",
                                                         "arguments": {"code": "print(2 + 2)"}}]},
    {"role": "tool", "content": "4", "tool_call_id": "c"},
    {"role": "assistant", "content": "Waiting.", "stop_reason": "eom"},
    {"role": "user", "content": "Thanks."}]


@pytest.mark.parametrize("dialog", [PLAIN, PLAIN[1:], [PLAIN[0]] + TOOL_TURNS], ids=["system", "plain", "tools"])
@pytest.mark.parametrize("style", ["pythonic", "llama3_json"])
def test_dialogs_equal_metas(tok, meta, dialog, style):
    fmt = chat_format_for(tok, tool_style=style)
    assert isinstance(fmt, Llama4ChatFormat) and type(ChatFormat(tok)) is Llama4ChatFormat
    meta_style = ToolPromptFormat.python_list if style == "pythonic" else ToolPromptFormat.json
    expected = meta[1].encode_dialog_prompt([raw(m) for m in dialog], meta_style).tokens
    assert fmt.encode_dialog_prompt(dialog) == expected
    assert fmt.encode_header("tool") == meta[1]._encode_header("tool")


def llama32_doc_system():
    """The pythonic tool-system text as llama-models' own prompt-format document writes it (the only tool prompt
    llama-models 0.3.0 ships; Llama 4 uses the same call syntax), and the tool it lists."""
    doc = (Path(llama_models.__file__).parent / "llama3_2" / "text_prompt_format.md").read_text()
    head = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    start = doc.index(head + "You are an expert in composing functions") + len(head)
    text = doc[start:doc.index("<|eot_id|>", start)]
    return text, {"type": "function", "function": json.loads(text[text.index("\n["):])[0]}


def test_tool_dialog_with_llama_models_system_text_equals_metas(tok, meta):
    text, tool = llama32_doc_system()
    fmt = chat_format_for(tok)
    assert fmt.tool_style == "pythonic"
    turns = [{"role": "user", "content": "Weather in SF?"},
             {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "name": tool["function"]["name"],
                                                                  "arguments": {"city": "SF"}}]},
             {"role": "tool", "content": "sunny", "tool_call_id": "a"}]
    ours = fmt.encode_dialog_prompt(ToolDialog(turns, [tool], "pythonic"))
    expected = meta[1].encode_dialog_prompt([RawMessage(role="system", content=text)] + [raw(m) for m in turns],
                                            ToolPromptFormat.python_list).tokens
    assert ours == expected
    assert tok.decode(ours).endswith("<|eom|><|header_start|>assistant<|header_end|>\n\n")


def test_llama3_json_tool_dialog_equals_metas(tok, meta):
    """Llama 3.1's syntax (tool_style="llama3_json"): its system text and custom-tools user message (checked
    against llama-models' Llama 3.1 document in test_tool_format.py), then the turns."""
    fmt = chat_format_for(tok, tool_style="llama3_json")
    tools = [WEATHER]
    ours = fmt.encode_dialog_prompt(ToolDialog([PLAIN[0]] + TOOL_TURNS, tools, "llama3_json", today="1 May 2025"))
    lead = [RawMessage(role="system", content=meta_system_text("llama3_json", tools, PLAIN[0]["content"],
                                                               "1 May 2025")),
            RawMessage(role="user", content=meta_tools_message("llama3_json", tools))]
    expected = meta[1].encode_dialog_prompt(lead + [raw(m) for m in TOOL_TURNS], ToolPromptFormat.json).tokens
    assert ours == expected


REPLIES = ['[get_weather(city="Paris", days=3)]', '{"type": "function", "name": "get_weather", "parameters": '
           '{"city": "Oslo"}}', 'brave_search.call(query="llamas")', "<|python_start|>print(2 + 2)<|python_end|>",
           '<|python_start|>[get_weather(city="Rome")]<|python_end|>', "Just text, no call.",
           "<|header_start|>assistant<|header_end|>\n\nHello<|eot|>", "Calling now<|eom|>"]


@pytest.mark.parametrize("reply", REPLIES, ids=range(len(REPLIES)))
def test_replies_decode_as_metas(tok, meta, reply):
    fmt = chat_format_for(tok)
    ids = tok.encode(reply, bos=False, eos=False, allowed_special="all")
    ours = fmt.decode_assistant_message(ids, None)
    ref = meta[1].decode_assistant_message(ids, StopReason.out_of_tokens)
    assert ours["content"] == ref.content
    assert ours["stop_reason"] == {StopReason.end_of_turn: "eot", StopReason.end_of_message: "eom"}.get(
        ref.stop_reason, None)
    assert [(c["name"], c["arguments"]) for c in ours["tool_calls"]] == [
        (getattr(c.tool_name, "value", c.tool_name), c.arguments) for c in ref.tool_calls]


def test_the_servers_parser_reads_llama4_replies():
    assert parse("pythonic", '<|python_start|>[f(a=1), g(b="x")]<|python_end|>') == (None, [("f", {"a": 1}),
                                                                                            ("g", {"b": "x"})])
    assert parse("llama3_json", "<|python_start|>print(1)<|python_end|>") == (None, [("code_interpreter",
                                                                                      {"code": "print(1)"})])


def test_dialog_rules_and_image_content_are_refused(tok):
    fmt = chat_format_for(tok)
    image = [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}, {"type": "text", "text": "What?"}]
    with pytest.raises(ValueError, match="message 0: image content is not supported.*no vision encoder"):
        fmt.encode_dialog_prompt([{"role": "user", "content": image}])
    with pytest.raises(ValueError, match="a system message may only come first"):
        fmt.encode_dialog_prompt([PLAIN[1], PLAIN[0], PLAIN[3]])
    with pytest.raises(ValueError, match="last message must be from the user or a tool"):
        fmt.encode_dialog_prompt(PLAIN[:3])
    with pytest.raises(ValueError, match="unknown role"):
        fmt.encode_dialog_prompt([{"role": "robot", "content": "x"}])


# ------------------------------------------------------------------------------------------------- Meta's paths
def test_llama_models_llama4_names_import_from_llama_llama4(meta):
    import llama_models.llama4.tokenizer as meta_tok

    from llama.llama4 import chat_format, tokenizer

    for name in ("BASIC_SPECIAL_TOKENS", "LLAMA4_SPECIAL_TOKENS", "LLAMA4_TEXT_POST_TRAIN_SPECIAL_TOKENS",
                 "LLAMA4_VISION_SPECIAL_TOKENS", "LLAMA4_REASONING_SPECIAL_TOKENS", "TIKTOKEN_MAX_ENCODE_CHARS",
                 "MAX_NO_WHITESPACES_CHARS"):
        assert getattr(tokenizer, name) == getattr(meta_tok, name), name
    assert tokenizer.get_reserved_special_tokens("x", 2, 3) == meta_tok.get_reserved_special_tokens("x", 2, 3)
    ours = tokenizer.Tokenizer(PATH)
    assert ours.encode("Hi <|eot|>", bos=True, eos=False) == meta[0].encode("Hi <|eot|>", bos=True, eos=False)

    fmt, ref = chat_format.ChatFormat(ours), meta[1]
    msgs = [raw(m) for m in [PLAIN[0]] + TOOL_TURNS]
    for style in (ToolPromptFormat.json, ToolPromptFormat.python_list):
        assert fmt.encode_dialog_prompt(msgs, style).tokens == ref.encode_dialog_prompt(msgs, style).tokens
        assert fmt.encode_message(msgs[2], style)[0] == ref.encode_message(msgs[2], style)[0]
    assert fmt.encode_dialog_prompt(msgs).images is None
    assert [chat_format.role_str(r) for r in ("user", "tool")] == ["user", "ipython"]
    with pytest.raises(ValueError, match="vision_args: image content is not supported"):
        chat_format.ChatFormat(ours, vision_args=object())
    with pytest.raises(ValueError, match="tool_prompt_format must be one of"):
        fmt.encode_dialog_prompt(msgs, ToolPromptFormat.function_tag)
