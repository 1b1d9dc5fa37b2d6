"""Tool dialogs rendered token for token as the references render them: Meta's llama-models ChatFormat for Llama 3
(JSON calls and built-ins for 3.1, the pythonic list for 3.2), and transformers' apply_chat_template(tools=...)
for real models' Hugging Face templates (llama.cpp's models/templates/, tests/peers.py); and replies parsed back into calls."""

import json
from pathlib import Path

import peers
import pytest
from conftest import SHARED

from llama.tokenizers.chat_format import (
    Llama3ChatFormat,
    TemplateChatFormat,
    template_environment,
)
from llama.tokenizers.tool_format import (
    ToolDialog,
    call_text,
    family_of,
    meta_system_text,
    parse,
)

GGUF = SHARED / "models/smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city <& 'quotes'> é",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "brave_search", "description": "Web search",
                                           "parameters": {"type": "object",
                                                          "properties": {"query": {"type": "string"}}}}}


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
    msgs = dialog() + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "s", "name": "brave_search",
                                                             "arguments": {"query": "Oslo weather"}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "s"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "name": "code_interpreter",
                                                             "arguments": {"code": "print(2 + 2)"}}]},
        {"role": "ipython", "content": "4", "tool_call_id": "c"},
        {"role": "user", "content": "Done?"}]
    tools = [WEATHER, SEARCH]
    ours = fmt.encode_dialog_prompt(ToolDialog(msgs, tools, family))

    def raw(m):
        calls = [ToolCall(call_id=c["id"], tool_name=BuiltinTool[c["name"]] if c["name"] in BuiltinTool.__members__
                          else c["name"], arguments=c["arguments"]) for c in m.get("tool_calls", [])]
        builtin = calls and all(isinstance(c.tool_name, BuiltinTool) for c in calls)
        role = "tool" if m["role"] in ("tool", "ipython") else m["role"]
        return RawMessage(role=role, content=m["content"], tool_calls=calls,
                          stop_reason=StopReason.end_of_message if builtin else None)

    system = RawMessage(role="system", content=meta_system_text(family, tools, msgs[0]["content"]))
    style = ToolPromptFormat.json if family == "llama3_json" else ToolPromptFormat.python_list
    expected = ref.encode_dialog_prompt([system] + [raw(m) for m in msgs[1:]], style).tokens
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


# ------------------------------------------------------------------------------------------------ templates
@pytest.fixture(scope="module")
def toks():
    """Our tokenizer and transformers' for the same GGUF file (SmolLM2)."""
    from transformers import AutoTokenizer

    from llama.formats.gguf_file import _Reader
    from llama.tokenizers.huggingface import from_gguf

    gguf = GGUF if GGUF.exists() else pytest.skip(f"{GGUF} is absent")
    return from_gguf(_Reader(str(gguf)), gguf), AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


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
