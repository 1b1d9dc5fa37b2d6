"""Qwen3's chat template through the Python API and the server: its thinking switch (chat_template_kwargs
{"enable_thinking": false}, vLLM's and SGLang's field, which the openai client sends through extra_body), the
reasoning split of its <think> blocks, and its Hermes-style tool calls (tool definitions in the system turn, results
as <tool_response> in user turns, several calls, a call after a think block), whole and streamed.

The model: random weights over Qwen3's vocabulary and real template (tests/helpers.py's build_qwen3_chat), its
reply forced token by token; the prompts are compared with transformers' apply_chat_template on the same
tokenizer.json and template."""

import json

import pytest
import helpers
from helpers import build_qwen3_chat, ready_client

from llama.tokenizers.chat_format import with_template_kwargs

openai = pytest.importorskip("openai", reason="the server tests need the openai client: pip install -e '.[test]'")
pytest.importorskip("starlette", reason="the server needs the serve extra: pip install -e '.[serve]'")
transformers = pytest.importorskip("transformers")

ASK = [{"role": "user", "content": "What is 12345 + 1?"}]
THOUGHT, ANSWER = "Add one to the last digit.", "It is 12346."
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
CITY = {"type": "string"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": CITY, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"city": "Oslo"})]
# Compact JSON: what the call grammar lets through (llama/sample/tool_grammar.py's JSON_STYLE)
CALLS_TEXT = "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a}, separators=(",", ":"))}\n</tool_call>'
                       for n, a in CALLS)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_qwen3_chat(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def reference(qwen3):
    """transformers' tokenizer over the same tokenizer.json, rendering Qwen3's template."""
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=qwen3.tokenizer.source)

    def render(messages, **kw):
        ids = ref.apply_chat_template(messages, chat_template=qwen3.tokenizer.chat_template,
                                      add_generation_prompt=True, tokenize=True, **kw)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return render


def forcing(tokenizer, text):
    """helpers.forcing of text's tokens."""
    return helpers.forcing(tokenizer.encode(text, bos=False, eos=False), tokenizer.eos_id)


class Forced:
    """The in-process server, each request's reply forced to `reply` and its prompt kept in `prompts`."""

    def __init__(self, gen, client, app):
        self.gen, self.http, self.reply, self.prompts = gen, client, REPLY, []
        engine = app.state.llama.engine
        submit = engine.submit_samples

        def forced(p, n, **kw):
            reqs = submit(p, n, **kw, logits_processors=[forcing(gen.tokenizer, self.reply)])
            self.prompts.append(list(reqs[0].prompt))
            return reqs
        engine.submit_samples = forced
        self.client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client,
                                    max_retries=0)


@pytest.fixture(scope="module")
def server(qwen3):

    from llama.serve.app import create_app

    app = create_app(lambda: qwen3, "qwen3")
    with ready_client(app) as client:
        yield Forced(qwen3, client, app)


def create(server, reply, **kw):
    server.reply = reply
    return server.client.chat.completions.create(model="qwen3", max_tokens=200, **kw)


def streamed(server, reply, extra_body=None, **kw):
    """(reasoning, content, tool calls, finish_reason) reassembled from a stream's events (read whole: the
    openai client's stream closes at [DONE], before the server's last write), checking reasoning deltas come
    before any content or call and each call's first delta carries its id and name."""
    server.reply = reply
    body = {"model": "qwen3", "max_tokens": 200, "stream": True, **kw, **(extra_body or {})}
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    reasoning, content, calls, finish, later = "", "", {}, None, False
    for chunk in events[:-1]:
        ch = json.loads(chunk)["choices"][0]
        delta = ch["delta"]
        assert not (delta.get("reasoning_content") and later), "reasoning after content"
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        later = later or bool(delta.get("content") or delta.get("tool_calls"))
        for d in delta.get("tool_calls") or []:
            if d["index"] not in calls:
                assert d["id"] and d["type"] == "function" and d["function"]["arguments"] == ""
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
        finish = ch["finish_reason"] or finish
    return reasoning, content, [calls[k] for k in sorted(calls)], finish


def parsed(calls):
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("enable", [None, True, False])
def test_thinking_switch_renders_as_transformers_and_splits_the_reply(server, reference, enable):
    """chat_template_kwargs reaches the template (off: the empty think block closes the generation prompt, on or
    unset: the model opens its own); the reply's block is reasoning_content, whole and streamed; off, a reply
    without a block has none."""
    kw = {} if enable is None else {"extra_body": {"chat_template_kwargs": {"enable_thinking": enable}}}
    reply = ANSWER if enable is False else REPLY
    r = create(server, reply, messages=ASK, seed=1, **kw)
    expected = reference(ASK, **({} if enable is None else {"enable_thinking": enable}))
    assert server.prompts[-1] == expected
    empty = server.gen.tokenizer.encode("<think>\n\n</think>\n\n", bos=False, eos=False)
    assert (expected[-len(empty):] == empty) is (enable is False)
    message = r.choices[0].message
    assert message.content == ANSWER and r.choices[0].finish_reason == "stop"
    assert getattr(message, "reasoning_content", None) == (None if enable is False else THOUGHT)
    assert streamed(server, reply, messages=ASK, seed=1, **kw) == ("" if enable is False else THOUGHT, ANSWER, [],
                                                                   "stop")


def test_tool_calls_after_a_think_block_whole_and_streamed(server, reference):
    """Two Hermes calls after the model's reasoning: the tools in the system turn as the template writes them,
    the block as reasoning_content, the calls as tool_calls (finish_reason "tool_calls"), whole and streamed."""
    reply = f"<think>\nTwo cities, two tools.\n</think>\n\n{CALLS_TEXT}"
    r = create(server, reply, messages=ASK, tools=TOOLS, seed=3)
    assert server.prompts[-1] == reference(ASK, tools=TOOLS)
    assert "<tools>" in server.gen.tokenizer.decode(server.prompts[-1])
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not message.content
    assert message.reasoning_content == "Two cities, two tools."
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert parsed(calls) == CALLS and all(c["id"].startswith("call_") for c in calls)
    assert streamed(server, reply, messages=ASK, tools=TOOLS, seed=3) == ("Two cities, two tools.", "", calls,
                                                                          "tool_calls")
    # thinking off: the calls come first thing, no reasoning
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = create(server, CALLS_TEXT, messages=ASK, tools=TOOLS, tool_choice="required", seed=3, extra_body=off)
    assert server.prompts[-1] == reference(ASK, tools=TOOLS, enable_thinking=False)
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == CALLS
    thought, content, calls, finish = streamed(server, CALLS_TEXT, messages=ASK, tools=TOOLS, seed=3, extra_body=off)
    assert (thought, content, parsed(calls), finish) == ("", "", CALLS, "tool_calls")


def test_a_tool_loop_renders_as_transformers(server, reference):
    """The history of a tool loop: the assistant's two calls with its reasoning_content (Qwen3's template shows it
    after the last user message), both results in one user turn of <tool_response> blocks; the model answers."""
    calls = [{"id": f"call_{k}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
             for k, (n, a) in enumerate(CALLS)]
    history = [{"role": "system", "content": "You are terse."}] + ASK + [
        {"role": "assistant", "content": "", "reasoning_content": "Two cities.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"forecast": "sunny"}'},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"time": "12:00"}'}]
    r = create(server, "<think>\nBoth answered.\n</think>\n\nSunny; noon in Oslo.", messages=history, tools=TOOLS)
    ref_history = [dict(m) for m in history]
    ref_history[2] = {**history[2], "tool_calls": [{**c, "function": {**c["function"], "arguments": a}}
                                                   for c, (_, a) in zip(calls, CALLS)]}
    assert server.prompts[-1] == reference(ref_history, tools=TOOLS)
    text = server.gen.tokenizer.decode(server.prompts[-1])
    assert "<think>\nTwo cities.\n</think>" in text and text.count("<|im_start|>user") == 2
    assert text.count("<tool_response>") == 2 and text.count("<tool_call>") == 2 + 2  # the system text has two
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("Both answered.", "Sunny; noon in Oslo.")
    assert not message.tool_calls and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("patch, param", [
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": [["enable_thinking", False]]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"enable_thinking": 0}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"messages": ASK + [{"role": "assistant", "content": "x", "reasoning_content": 3}, ASK[0]]},
     "messages[1].reasoning_content"),
    ({"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]}, "messages[0].reasoning_content"),
])
def test_bad_template_fields_are_400_naming_them(server, patch, param):
    r = server.http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **patch})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_unknown_template_kwargs_pass_through(server, reference):
    """As vLLM: a key the template does not read is accepted and changes nothing."""
    r = create(server, ANSWER, messages=ASK, extra_body={"chat_template_kwargs": {"custom": {"a": [1, None]},
                                                                                  "enable_thinking": False}})
    assert r.choices[0].message.content == ANSWER
    assert server.prompts[-1] == reference(ASK, enable_thinking=False)


def test_the_python_api_takes_chat_template_kwargs(qwen3, reference):
    """chat_completion and stream_chat take the same chat_template_kwargs (keyword only; Meta's positional
    signature unchanged); bad ones are refused by name before anything runs."""
    force = forcing(qwen3.tokenizer, ANSWER)
    off = {"enable_thinking": False}
    out = qwen3.chat_completion([ASK], 0.6, 0.9, 32, False, logits_processors=[force], chat_template_kwargs=off,
                                split_reasoning=True)[0]["generation"]
    assert out == {"role": "assistant", "content": ANSWER}
    assert qwen3.inputs.encode_dialog(with_template_kwargs(ASK, off))[0] == reference(ASK, enable_thinking=False)
    assert "".join(qwen3.stream_chat(ASK, chat_template_kwargs=off, logits_processors=[forcing(
        qwen3.tokenizer, ANSWER)], max_gen_len=32)) == ANSWER
    thought = qwen3.chat_completion([ASK], logits_processors=[forcing(qwen3.tokenizer, REPLY)], max_gen_len=32,
                                    split_reasoning=True, chat_template_kwargs={"enable_thinking": True})
    assert thought[0]["generation"]["reasoning_content"] == THOUGHT
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        qwen3.chat_completion([ASK], chat_template_kwargs="enable_thinking=False")
    with pytest.raises(ValueError, match="chat_template_kwargs: 'enable_thinking' must be true or false"):
        qwen3.chat_completion([ASK], chat_template_kwargs={"enable_thinking": "no"})
    with pytest.raises(ValueError, match="chat_template_kwargs: 'tools' is set by the chat format"):
        qwen3.stream_chat(ASK, chat_template_kwargs={"tools": []})
    with pytest.raises(ValueError, match="must be a JSON value"):
        qwen3.chat_completion([ASK], chat_template_kwargs={"x": object()})
