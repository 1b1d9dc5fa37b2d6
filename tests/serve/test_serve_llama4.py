"""Llama 4's tokenizer and chat format through the Python API and the server, on a tiny random Llama-architecture
checkpoint with Llama 4's vocabulary (202,048) and llama-models' own Llama 4 tokenizer.model: the prompt is Llama
4's (tests/tokenizers/test_llama4.py checks it against llama-models' ChatFormat), tool calls come back in
OpenAI's shape, whole and streamed, the tool result goes back, and image content is a 400 naming the missing
vision encoder."""

import json
from pathlib import Path

import httpx
import pytest
from serve_util import Server

pytest.importorskip("llguidance", reason="tool calls need llguidance: pip install -e '.[serve]'")
llama_models = pytest.importorskip("llama_models", reason="llama-models (Meta's reference code) is a test dependency")

TOKENIZER = Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"
PARAMS = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "multiple_of": 32, "norm_eps": 1e-5,
          "vocab_size": 202048, "rope_theta": 500000.0}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from llama.hub.demo import write_random_checkpoint

    d = tmp_path_factory.mktemp("rand_llama4_vocab")
    write_random_checkpoint(d, PARAMS, tokenizer_path=TOKENIZER, std=0.5)
    return d


@pytest.fixture(scope="module")
def gen(ckpt):
    from llama import Llama

    return Llama.build(str(ckpt), str(ckpt / "tokenizer.model"), max_seq_len=512, max_batch_size=2)


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(ckpt, "--tokenizer_path", str(ckpt / "tokenizer.model"), "--max_seq_len", "512", "--max_batch_size",
               "2", "--model-name", "l4", timeout=300)
    yield s
    s.close()


def test_python_api_uses_llama4s_tokenizer_and_chat_format(gen):
    from llama.tokenizers.llama4 import Llama4Tokenizer
    from llama.tokenizers.llama4_chat import Llama4ChatFormat

    assert isinstance(gen.tokenizer, Llama4Tokenizer) and isinstance(gen.formatter, Llama4ChatFormat)
    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "name": "get_weather",
                                                                   "arguments": {"city": "Oslo", "days": 1}}]},
              {"role": "tool", "content": "rain"}]
    out = gen.chat_completion([dialog], temperature=0.0, max_gen_len=8, logprobs=True)[0]
    assert out["generation"]["role"] == "assistant" and isinstance(out["generation"]["content"], str)
    prompt = gen.formatter.encode_dialog_prompt(dialog)
    text = gen.tokenizer.decode(prompt)
    assert text.startswith("<|begin_of_text|><|header_start|>system<|header_end|>\n\nBe brief.<|eot|>")
    assert '[get_weather(city="Oslo", days=1)]<|eom|><|header_start|>ipython<|header_end|>\n\nrain<|eom|>' in text
    with pytest.raises(ValueError, match="image content is not supported.*no vision encoder"):
        gen.chat_completion([[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]])


def test_tool_calls_whole_and_streamed_then_the_result(server, gen):
    from llama.tokenizers.tool_format import ToolDialog

    client = server.client()
    kw = dict(model="l4", messages=ASK, tools=[WEATHER], tool_choice="required", seed=3, max_tokens=60,
              parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1, msg
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "days"} and 1 <= args["days"] <= 9
    shown = ToolDialog([dict(m) for m in ASK], [WEATHER], "pythonic")
    assert r.usage.prompt_tokens == len(gen.formatter.encode_dialog_prompt(shown))  # Llama 4's pythonic prompt

    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                c["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls.values()) == [{"id": call.id, "name": "get_weather", "arguments": call.function.arguments}]

    history = ASK + [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sun"}]
    final = client.chat.completions.create(model="l4", messages=history, tools=[WEATHER], tool_choice="none",
                                           seed=5, max_tokens=10)
    assert final.choices[0].finish_reason in ("stop", "length") and not final.choices[0].message.tool_calls
    turns = [dict(ASK[0]), {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "name": "get_weather", "arguments": args}]}, {"role": "tool", "content": "sun"}]
    assert final.usage.prompt_tokens == len(gen.formatter.encode_dialog_prompt(ToolDialog(turns, [], "pythonic")))


def test_image_content_is_a_400_naming_the_missing_capability(server):
    body = {"model": "l4", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1]" and "no vision encoder" in err["message"]
