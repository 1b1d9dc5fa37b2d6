"""Tool dialogs rendered token for token as the references render them: Meta's llama-models ChatFormat for Llama 3
(JSON calls and built-ins for 3.1, the pythonic list for 3.2), with the tool prompts' text as llama-models' own
templates wrote it in its prompt-format documents, and transformers' apply_chat_template(tools=...) for real
models' Hugging Face templates (llama.cpp's models/templates/, unpacked by tests/peers.py); and replies parsed
back into calls."""

import json
import re
from pathlib import Path

import peers
import pytest
from conftest import SHARED
from helpers import transformers_reading_gguf

from llama.tokenizers.chat_format import Llama3ChatFormat, TemplateChatFormat, template_environment
from llama.tokenizers.tool_format import ToolDialog, call_text, family_of, meta_system_text, meta_tools_message, parse

GGUF = SHARED / "models/smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city <& 'quotes'> é",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "brave_search", "description": "Web search",
                                           "parameters": {"type": "object",
                                                          "properties": {"query": {"type": "string"}}}}}

DOC_DATE = "21 September 2024"  # the day llama-models generated its prompt-format document
DOC_SYSTEM = "You are a helpful assistant."  # its examples' instruction (template_data.INSTRUCTION)
# The built-ins of its "Builtin Tool Calling" example (BuiltinToolGenerator.data_examples()[0])
DOC_BUILTINS = ("code_interpreter", "brave_search", "wolfram_alpha")


def meta():
    llama_models = pytest.importorskip("llama_models")
    path = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    from llama.tokenizers.llama3 import Llama3Tokenizer

    return Llama3Tokenizer(path), ChatFormat(Tokenizer(path))


def dialog(calls_per_turn=1, ids=("call_a", "call_b")):
    calls = [{"id": ids[k], "name": "get_weather", "arguments": {"city": c, "days": 3}}
             for k, c in enumerate(["Paris", "Oslo"][:calls_per_turn])]
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": calls}]
    msgs += [{"role": "tool", "content": json.dumps({"forecast": "sunny"}), "tool_call_id": c["id"]} for c in calls]
    return msgs + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks. And tomorrow?"}]


def builtin_turns(search_result: str = "rain") -> list:
    """A built-in search and a code_interpreter call with their results, then the user's next turn."""
    return [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "s", "name": "brave_search",
                                                             "arguments": {"query": "Oslo weather"}}]},
        {"role": "tool", "content": search_result, "tool_call_id": "s"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "name": "code_interpreter",
                                                             "arguments": {"code": "print(2 + 2)"}}]},
        {"role": "ipython", "content": "4", "tool_call_id": "c"},
        {"role": "user", "content": "Done?"}]


@pytest.mark.parametrize("family", ["llama3_json", "pythonic"])
def test_meta_llama3_tool_dialog_equals_llama_models(family):
    pytest.importorskip("llama_models")
    from llama_models.datatypes import (
        BuiltinTool,
        RawMessage,
        StopReason,
        ToolCall,
        ToolPromptFormat,
    )

    ours_tok, ref = meta()
    fmt = Llama3ChatFormat(ours_tok, tool_style=family)
    assert family_of(fmt) == family
    msgs = dialog() + builtin_turns()
    tools = [WEATHER, SEARCH]
    ours = fmt.encode_dialog_prompt(ToolDialog(msgs, tools, family, today=DOC_DATE))

    def raw(m):
        calls = [ToolCall(call_id=c["id"], tool_name=BuiltinTool[c["name"]] if c["name"] in BuiltinTool.__members__
                          else c["name"], arguments=c["arguments"]) for c in m.get("tool_calls", [])]
        builtin = calls and all(isinstance(c.tool_name, BuiltinTool) for c in calls)
        role = "tool" if m["role"] in ("tool", "ipython") else m["role"]
        return RawMessage(role=role, content=m["content"], tool_calls=calls,
                          stop_reason=StopReason.end_of_message if builtin else None)

    lead = [RawMessage(role="system", content=meta_system_text(family, tools, msgs[0]["content"], DOC_DATE))]
    listed = meta_tools_message(family, tools)  # its text: test_llama31_tool_prompt_equals_llama_models_own_text
    lead += [RawMessage(role="user", content=listed)] if listed else []
    style = ToolPromptFormat.json if family == "llama3_json" else ToolPromptFormat.python_list
    expected = ref.encode_dialog_prompt(lead + [raw(m) for m in msgs[1:]], style).tokens
    assert ours == expected
    text = ours_tok.decode(ours)
    assert "<|python_tag|>print(2 + 2)<|eom_id|>" in text and "brave_search.call(query=\"Oslo weather\")<|eom_id|>" in text
    assert ("[get_weather(city=\"Paris\", days=3)]" if family == "pythonic" else '"parameters": {"city": "Paris"') in text


def test_llama32_system_prompt_equals_llama_models_doc():
    """The pythonic system prompt, character for character as llama-models' Llama 3.2 prompt-format document
    shows it for its get_weather example."""
    llama_models = pytest.importorskip("llama_models")

    doc = (Path(llama_models.__file__).parent / "llama3_2" / "text_prompt_format.md").read_text()
    head = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    start = doc.index(head + "You are an expert in composing functions") + len(head)
    expected = doc[start:doc.index("<|eot_id|>", start)]
    fn = json.loads(expected[expected.index("\n["):])[0]
    assert meta_system_text("pythonic", [{"type": "function", "function": fn}], None) == expected


# ------------------------------------------------------------------------------------------------ Meta's own text
def meta_doc(section: str):
    """(prompt, reply) of an example in llama-models' Llama 3.1 prompt-format document, which llama-models wrote
    with its own prompt templates (llama3/prompt_templates: SystemDefaultGenerator, BuiltinToolGenerator,
    JsonCustomToolGenerator, joined by LLama31Interface.system_messages); 0.3.0 ships the document, the templates
    moved to llama-stack."""
    llama_models = pytest.importorskip("llama_models")
    doc = (Path(llama_models.__file__).parent / "llama3_1" / "prompt_format.md").read_text()
    return tuple(re.findall(r"```\n(.*?)\n```", doc[doc.index(f"## {section}\n"):], re.S)[:2])


def doc_turns(prompt: str):
    """[(role, content)] of a document's prompt, which must be exactly those turns and the assistant header."""
    turns = re.findall(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", prompt, re.S)
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert prompt == ("<|begin_of_text|>" + "".join(head.format(r) + c + "<|eot_id|>" for r, c in turns)
                      + head.format("assistant"))
    return turns


def listed_functions(text: str):
    """The function objects a JsonCustomToolGenerator message lists."""
    body = text[text.index("JSON format:\n") + len("JSON format:\n"):text.rindex("Return function calls")].strip()
    decoder, pos, out = json.JSONDecoder(), 0, []
    while pos < len(body):
        obj, pos = decoder.raw_decode(body, pos)
        out.append(obj["function"])
        pos += len(body[pos:]) - len(body[pos:].lstrip())
    return out


@pytest.mark.parametrize("section, calls", [
    ("JSON based tool calling", [("trending_songs", {"n": "10", "genre": "all"})]),
    ("Builtin Tool Calling", [("brave_search", {"query": "latest price of 1oz gold"})]),
])
def test_llama31_tool_prompt_equals_llama_models_own_text(section, calls):
    """Meta's 3.1 tool prompt as llama-models' own templates wrote it (the date lines, Environment: ipython, the
    built-ins' Tools line, custom tools in a user message after the system message, in Meta's JSON layout), text
    and tokens (llama-models' ChatFormat); the reply the document shows parses to its call. The custom tool is
    the one the document lists (its parameters in llama-models' own shape, which we write as given)."""
    from llama_models.datatypes import RawMessage

    prompt, reply = meta_doc(section)
    turns = doc_turns(prompt)
    ours_tok, ref = meta()
    expected = ref.encode_dialog_prompt([RawMessage(role=r, content=c) for r, c in turns]).tokens
    assert ours_tok.decode(expected) == prompt
    custom = [c for r, c in turns[1:-1] if r == "user"]
    fns = listed_functions(custom[0]) if custom else [{"name": n} for n in DOC_BUILTINS]
    msgs = [{"role": "system", "content": DOC_SYSTEM}, {"role": "user", "content": turns[-1][1]}]
    dialog = ToolDialog(msgs, [{"type": "function", "function": f} for f in fns], "llama3_json", today=DOC_DATE)
    ours = Llama3ChatFormat(ours_tok, tool_style="llama3_json").encode_dialog_prompt(dialog)
    assert ours_tok.decode(ours) == prompt
    assert ours == expected
    assert reply.endswith("<|eom_id|>") and parse("llama3_json", reply[:-len("<|eom_id|>")]) == (None, calls)


def test_llama31_tools_message_keeps_the_schema():
    """Where we differ from llama-models on purpose: a tool's parameters are its JSON schema as given (types,
    nesting, text), not JsonCustomToolGenerator's list of {"name": {"type": "object"}}; its layout stays."""
    text = meta_tools_message("llama3_json", [WEATHER, SEARCH])
    assert listed_functions(text) == [WEATHER["function"]]  # the built-in is in the system message's Tools line
    assert '"required": ["city"]' in text and "é" in text and meta_tools_message("pythonic", [WEATHER]) is None


# ------------------------------------------------------------------------------------------------ templates
@pytest.fixture(scope="module")
def toks():
    """Our tokenizer and transformers' for the same GGUF file (SmolLM2)."""
    from transformers import AutoTokenizer

    from llama.formats.gguf_reader import Reader
    from llama.tokenizers.huggingface import from_gguf

    gguf = GGUF if GGUF.exists() else pytest.skip(f"{GGUF} is absent")
    with transformers_reading_gguf():
        ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return from_gguf(Reader(str(gguf)), gguf), ref


def openai_messages(msgs):
    """The messages as a client sends them, with arguments as objects (as vLLM passes them to templates)."""
    out = []
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("name, family, calls, ids", [
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json", 1, ("call_a", "call_b")),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3_json", 1, ("call_a", "call_b")),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", 2, ("call_a", "call_b")),
    ("Qwen-Qwen3-0.6B.jinja", "hermes", 2, ("call_a", "call_b")),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", 2, ("abcdefghi", "ABCDEFGH1")),
])
def test_template_tool_dialog_equals_transformers(toks, name, family, calls, ids):
    ours_tok, hf_tok = toks
    template = peers.template(name)
    fmt = TemplateChatFormat(ours_tok, template)
    assert family_of(fmt) == family
    msgs = dialog(calls, ids)
    if family == "mistral":  # its template allows no system message before tools and alternation
        msgs = msgs[1:]
    ours = fmt.encode_dialog_prompt(ToolDialog(msgs, [WEATHER], family))
    kw = dict(tools=[WEATHER], chat_template=template, add_generation_prompt=True)
    text = hf_tok.apply_chat_template(openai_messages(msgs), tokenize=False, **kw)
    assert ours_tok.decode(ours) == text
    ref = hf_tok.apply_chat_template(openai_messages(msgs), tokenize=True, **kw)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert ours == list(ref)
    assert "get_weather" in text and "sunny" in text


def test_jinja_has_hugging_face_globals_and_tojson():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    source = ('{{ x | tojson }}|{{ x | tojson(indent=2, sort_keys=true) }}|'
              '{{ x | tojson(separators=(",", ":"), ensure_ascii=true) }}|{{ strftime_now("%Y") | length }}|'
              '{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}')
    x = {"b": "<é>", "a": 1}
    ours = template_environment().from_string(source).render(x=x)
    assert ours == _compile_jinja_template(source).render(x=x)
    assert ours.startswith('{"b": "<é>", "a": 1}|')  # not Jinja's own tojson (HTML-escaped, sorted)
    with pytest.raises(Exception, match="nope"):
        template_environment().from_string('{{ raise_exception("nope") }}').render()


# ------------------------------------------------------------------------------------------------ parsing
CALL = {"id": "x", "name": "get_weather", "arguments": {"city": "Paris", "days": 3, "ok": True, "tags": ["a"]}}


@pytest.mark.parametrize("family", ["llama3_json", "pythonic", "hermes", "generic"])
def test_written_calls_parse_back(family):
    assert parse(family, call_text(family, CALL)) == (None, [("get_weather", CALL["arguments"])])


@pytest.mark.parametrize("family, text, calls, content", [
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
     [("f", {"a": 1}), ("g", {})], None),
    ("llama3_json", '<|python_tag|>brave_search.call(query="Oslo")', [("brave_search", {"query": "Oslo"})], None),
    ("llama3_json", "<|python_tag|>print(1)", [("code_interpreter", {"code": "print(1)"})], None),
    ("llama3_json", "The answer is {42}.", [], "The answer is {42}."),
    ("pythonic", '[get_weather(city="San Francisco", metric="celsius"), f(x=true)]',
     [("get_weather", {"city": "San Francisco", "metric": "celsius"}), ("f", {"x": True})], None),
    ("pythonic", "[1, 2] are numbers", [], "[1, 2] are numbers"),
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": "b"}}\n</tool_call>', [("f", {"a": "b"})],
     "Sure."),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 2}"}\n</tool_call>', [("f", {"a": 2})], None),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
     [("f", {"a": 1}), ("g", {})], None),
    ("mistral", "[not a call]", [], "[not a call]"),
])
def test_parse_families(family, text, calls, content):
    assert parse(family, text) == (content, calls)


def test_pythonic_parse_agrees_with_llama_models():
    pytest.importorskip("llama_models")
    from llama_models.llama3.tool_utils import parse_python_list_for_function_calls

    text = '[get_weather(city="Paris", days=3), get_time(city="Oslo")]'
    assert parse("pythonic", text)[1] == parse_python_list_for_function_calls(text)


def test_meta_checkpoints_pick_their_versions_tool_syntax():
    """3.2's 1B/3B shapes call tools as a pythonic list (as Meta's stack renders them), 3.1's as JSON; tool_style
    overrides (3.3 70B has 3.1 70B's shape)."""
    from llama.model import ModelArgs
    from llama.tokenizers.chat_format import chat_format_for

    ours_tok, _ = meta()
    llama32_3b = ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, use_scaled_rope=True)
    llama31_8b = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, use_scaled_rope=True)
    assert family_of(chat_format_for(ours_tok, llama32_3b)) == "pythonic"
    assert family_of(chat_format_for(ours_tok, llama31_8b)) == "llama3_json"
    assert family_of(chat_format_for(ours_tok, None)) == "llama3_json"
    assert family_of(chat_format_for(ours_tok, llama31_8b, "pythonic")) == "pythonic"
    with pytest.raises(ValueError, match="tool_style must be one of"):
        chat_format_for(ours_tok, None, "xml")
