"""Tool calling through the official openai client against the real server (SmolLM2, whose template has no tools:
the generic tool prompt plus a grammar): a call with schema-valid arguments, the client runs it, the result goes
back, the model answers; plain and streamed, with tool_choice "required", a named function and "auto". Also the
penalties on the wire and the 400s of malformed tool fields."""

import json

import httpx
import pytest

from conftest import SHARED, need
from serve_util import Server

GGUF = SHARED / "models/smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CITY = {"type": "string", "minLength": 1, "maxLength": 20}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 14}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


MODEL = "smol"


def check_error(resp, status: int, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def server():
    s = Server(need(GGUF), "--max_seq_len", "2048", "--max_batch_size", "4", "--model-name", MODEL, timeout=400)
    yield s
    s.close()


def valid(call, tools=TOOLS) -> dict:
    """A call's arguments, checked against its function's schema (jsonschema, the reference validator)."""
    import jsonschema

    fn = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["parameters"])
    assert set(args) <= set(fn["parameters"]["properties"])
    return args


def run(call) -> str:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        return json.dumps({"city": args["city"], "forecast": ["sunny"] * args["days"]})
    return json.dumps({"city": args["city"], "time": "12:00"})


def reassemble(stream):
    """Streamed chunks -> (content, tool_calls as dicts, finish_reason), checking OpenAI's delta order: each
    call's first delta has id, type and name, later ones only argument fragments."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        finish = ch.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def as_dicts(calls):
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls]


def cached(client, **kw):
    """The request sent twice, the second answer returned: its prompt then comes from the prefix cache, as the
    streamed request after it does. With prefix_cache="on" (the server's default) a cached prompt's last positions
    are computed by the row kernel where a fresh prompt's went through a GEMM; a seeded sample can differ at a near
    tie (docs/serving.md), so plain and streamed are compared in the same cache state."""
    client.chat.completions.create(**kw)
    return client.chat.completions.create(**kw)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_round_trip_forced(server, choice):
    client = server.client()
    kw = dict(model=MODEL, tools=TOOLS, tool_choice=choice, seed=5, max_tokens=120,
              parallel_tool_calls=False)
    first = cached(client, messages=ASK, **kw)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    valid(call)
    # streamed: the same calls, same ids (the request is seeded), in OpenAI's delta order
    content, calls, finish = reassemble(client.chat.completions.create(messages=ASK, stream=True, **kw))
    assert finish == "tool_calls" and calls == as_dicts(msg.tool_calls)
    # the client runs the call and sends the result back; the model answers
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": run(call)}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", seed=5,
                                           max_tokens=40)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


MANY = ["What is the weather in Paris, London and Rome for the next 3 days?",
        "Weather for Tokyo, Berlin, Madrid and Oslo this week, one call per city please.",
        "I need the forecast for Paris and for London, and the local time in Rome."]


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("ask", MANY)
def test_named_choice_returns_exactly_one_call(server, ask, seed):
    """A named tool_choice is one call of that function (as OpenAI and vLLM answer it), with parallel_tool_calls
    left at its default: prompts that ask for several calls still get one, plain and streamed."""
    client = server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": ask}], tools=TOOLS, seed=seed, max_tokens=200,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = cached(client, **kw)
    calls = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"], as_dicts(calls)
    valid(calls[0])
    content, streamed, finish = reassemble(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and not content and streamed == as_dicts(calls)


def test_parallel_calls_are_each_valid(server):
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", seed=2, max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for c in calls:
        valid(c)


def test_round_trip_auto(server):
    """"auto": free text stays free (the plain reply is ordinary text); once the model writes the trigger, the lazy
    grammar makes the call valid. A tiny model does not choose tools, so logit_bias nudges it toward the trigger's
    tokens (it still writes other text first)."""
    client = server.client()
    model = MODEL
    free = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, seed=1, max_tokens=30)
    assert free.choices[0].message.content and free.choices[0].finish_reason in ("stop", "length")
    trigger = httpx.post(server.url + "/tokenize", json={"content": "<tool_call>", "add_special": False}).json()
    kw = dict(model=model, tools=TOOLS, tool_choice="auto", seed=3, max_tokens=120, parallel_tool_calls=False,
              logit_bias={str(t): 5 for t in trigger["tokens"]})
    r = client.chat.completions.create(messages=ASK, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", msg
    call = msg.tool_calls[0]
    valid(call)
    _, calls, finish = reassemble(client.chat.completions.create(messages=ASK, stream=True, **kw))
    assert finish == "tool_calls" and calls == as_dicts(msg.tool_calls)
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": run(call)}]
    final = client.chat.completions.create(model=model, messages=history, tools=TOOLS, seed=5, max_tokens=40)
    assert final.choices[0].message.content or final.choices[0].message.tool_calls


def test_ids_are_deterministic_for_a_seed(server):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "seed": 9, "max_tokens": 120,
            "parallel_tool_calls": False, "n": 2}
    a = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    b = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    ids = lambda r: [c["message"]["tool_calls"][0]["id"] for c in r["choices"]]  # noqa: E731
    assert ids(a) == ids(b) and len(set(ids(a))) == 2


@pytest.mark.parametrize("patch, param", [
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function",
                                                                               "function": {"name": "f",
                                                                                            "arguments": "{x"}}]},
                         {"role": "tool", "tool_call_id": "a", "content": "1"}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": "x"}]}, "messages[1].tool_calls"),
    ({"messages": ASK + [{"role": "tool", "content": "1"}]}, "messages[1].tool_call_id"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
])
def test_malformed_tool_fields_are_400_naming_the_field(server, patch, param):
    body = {"messages": ASK, "max_tokens": 4, **patch}
    err = check_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60), 400, param)
    assert err["type"] == "invalid_request_error"


def test_penalties_accepted_and_applied(server):
    client = server.client()
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=40)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    pen = client.chat.completions.create(frequency_penalty=2.0, presence_penalty=1.0, **kw).choices[0].message.content
    rep = client.chat.completions.create(extra_body={"repetition_penalty": 1.5}, **kw).choices[0].message.content
    assert pen != plain and rep != plain
    # the same as the Python API's penalties offline is covered by tests/sample/test_penalties.py; here: a
    # request's penalized text does not depend on what runs beside it
    again = client.chat.completions.create(frequency_penalty=2.0, presence_penalty=1.0, n=2, **kw)
    assert [c.message.content for c in again.choices] == [pen, pen]
