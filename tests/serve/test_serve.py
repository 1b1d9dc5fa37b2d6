"""The OpenAI-compatible server (llama/serve), run for real: `python -m llama.serve` as a subprocess on stories260K,
driven by the official `openai` client and by raw HTTP for the error shapes and disconnects."""

import json
import time

import pytest
from conftest import STORIES, need

openai = pytest.importorskip("openai", reason="the server tests need the openai client: pip install -e '.[test]'")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette", reason="the server needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="the server needs the serve extra: pip install -e '.[serve]'")

from serve_util import Server  # noqa: E402

MAX_SEQ_LEN, BATCH, QUEUE = 512, 4, 2
ONCE = "Once upon a time"
CHAT = [{"role": "system", "content": "Tell short stories."}, {"role": "user", "content": "A story about a cat"}]
NO_EOS = {"2": -100}  # stories260K's EOS banned: long generations for the queue and disconnect tests


@pytest.fixture(scope="module")
def server():
    s = Server(need(STORIES), "--max_seq_len", str(MAX_SEQ_LEN), "--max_batch_size", str(BATCH),
               "--max-queue", str(QUEUE), "--model-name", "stories")
    yield s
    s.close()


@pytest.fixture(scope="module")
def local():
    """The same model in this process: the Python API's output is what the server must return."""
    from llama import Llama

    d = need(STORIES)
    return Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=MAX_SEQ_LEN, max_batch_size=BATCH)


def sse_events(resp):
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def check_error(resp, status: int, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ------------------------------------------------------------------------------------------- equal to the API
def test_completion_greedy_equals_python_api(server, local):
    c = server.client()
    out = c.completions.create(model="stories", prompt=ONCE, max_tokens=40, temperature=0)
    ref = local.text_completion([ONCE], temperature=0, max_gen_len=40)[0]["generation"]
    assert out.choices[0].text == ref
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len(local.tokenizer.encode(ONCE, bos=True, eos=False))
    assert out.usage.completion_tokens > 0 and out.object == "text_completion"
    streamed = c.completions.create(model="stories", prompt=ONCE, max_tokens=40, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == ref


def test_completion_seeded_n_and_prompt_list(server, local):
    c = server.client()
    prompts = [ONCE, "Lily and Ben went to the park"]
    out = c.completions.create(model="stories", prompt=prompts, max_tokens=24, temperature=0.9, top_p=0.95, n=2,
                               seed=11)
    ref = local.text_completion(prompts, temperature=0.9, top_p=0.95, max_gen_len=24, n=2, seed=11)
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in out.choices] == [r["generation"] for r in ref]
    assert out.choices[0].text != out.choices[1].text  # n samples differ
    # token ids as the prompt give the same text as the string
    ids = local.tokenizer.encode(ONCE, bos=True, eos=False)
    again = c.completions.create(model="stories", prompt=ids, max_tokens=24, temperature=0.9, top_p=0.95, n=2, seed=11)
    assert [ch.text for ch in again.choices] == [r["generation"] for r in ref[:2]]


def test_chat_equals_python_api_streamed_and_not(server, local):
    c = server.client()
    ref = local.chat_completion([CHAT], temperature=0.7, top_p=1.0, max_gen_len=30, seed=5)[0]["generation"]
    out = c.chat.completions.create(model="stories", messages=CHAT, max_tokens=30, temperature=0.7, seed=5)
    assert out.choices[0].message.content == ref["content"]
    assert out.choices[0].message.role == "assistant" and out.object == "chat.completion"
    chunks = list(c.chat.completions.create(model="stories", messages=CHAT, max_tokens=30, temperature=0.7, seed=5,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref["content"]
    assert chunks[-2].choices[0].finish_reason == out.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == out.usage.total_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_stop_strings(server, local):
    c = server.client()
    ref = local.text_completion([ONCE], temperature=0, max_gen_len=60, stop=["Lily", "."])[0]["generation"]
    out = c.completions.create(model="stories", prompt=ONCE, max_tokens=60, temperature=0, stop=["Lily", "."])
    assert out.choices[0].text == ref and "Lily" not in ref
    assert out.choices[0].finish_reason == "stop"
    one = c.completions.create(model="stories", prompt=ONCE, max_tokens=60, temperature=0, stop="Lily")
    assert "Lily" not in one.choices[0].text and one.choices[0].finish_reason == "stop"


def test_logprobs_and_echo(server, local):
    c = server.client()
    ref = local.text_completion([ONCE], temperature=0, max_gen_len=12, logprobs=True, echo=True)[0]
    out = c.completions.create(model="stories", prompt=ONCE, max_tokens=12, temperature=0, logprobs=0, echo=True)
    ch = out.choices[0]
    assert ch.text == ref["generation"] and ch.text.startswith(ONCE)
    assert ch.logprobs.tokens == ref["tokens"]
    assert ch.logprobs.token_logprobs[0] is None
    assert ch.logprobs.token_logprobs[1:] == pytest.approx(ref["logprobs"][1:], abs=1e-5)
    chat = c.chat.completions.create(model="stories", messages=CHAT, max_tokens=8, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(t.logprob <= 0 for t in content)
    streamed = list(c.chat.completions.create(model="stories", messages=CHAT, max_tokens=8, temperature=0,
                                              logprobs=True, stream=True))
    got = [t.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert got == pytest.approx([t.logprob for t in content], abs=1e-5)
    echoed = c.completions.create(model="stories", prompt=ONCE, max_tokens=12, temperature=0, echo=True, stream=True)
    assert "".join(ch.choices[0].text for ch in echoed) == ref["generation"]


def test_top_logprobs_in_both_shapes(server, local):
    """Completions' logprobs=k and chat's top_logprobs=k carry the Python API's top_logprobs alternatives: a dict
    piece -> log-probability per position (null for the first echoed token), and chat's token/logprob/bytes lists."""
    c = server.client()
    ref = local.text_completion([ONCE], temperature=0, max_gen_len=10, logprobs=True, top_logprobs=3, echo=True)[0]
    lp = c.completions.create(model="stories", prompt=ONCE, max_tokens=10, temperature=0, logprobs=3,
                              echo=True).choices[0].logprobs
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == len(ref["top_logprobs"]) == len(lp.tokens)
    for got, want in zip(lp.top_logprobs[1:], ref["top_logprobs"][1:]):
        assert list(got) == [a["token"] for a in want]
        assert list(got.values()) == pytest.approx([a["logprob"] for a in want], abs=1e-5)
    cref = local.chat_completion([CHAT], temperature=0, max_gen_len=8, logprobs=True, top_logprobs=2)[0]
    for stream in (False, True):
        out = c.chat.completions.create(model="stories", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                        top_logprobs=2, stream=stream)
        chunks = list(out) if stream else [out]
        content = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
        assert len(content) == len(cref["top_logprobs"]) > 0
        for t, want in zip(content, cref["top_logprobs"]):
            assert [a.token for a in t.top_logprobs] == [a["token"] for a in want]
            assert [a.logprob for a in t.top_logprobs] == pytest.approx([a["logprob"] for a in want], abs=1e-5)
            assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)  # greedy: the best one
            assert t.top_logprobs[0].bytes == list(t.top_logprobs[0].token.encode())
    check_error(httpx.post(server.url + "/v1/chat/completions",
                           json={"messages": CHAT, "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs")
    check_error(httpx.post(server.url + "/v1/completions", json={"prompt": ONCE, "logprobs": 6}), 400, "logprobs")


def test_models_health_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["stories"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("llama_requests_running", "llama_requests_waiting", "llama_generation_tokens_total",
                 "llama_prompt_tokens_total", "llama_time_to_first_token_seconds_bucket",
                 "llama_time_per_output_token_seconds_bucket"):
        assert name in text, name


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("body, param", [
    ({"prompt": ONCE, "temperature": -1}, "temperature"),
    ({"prompt": ONCE, "top_p": 0}, "top_p"),
    ({"prompt": ONCE, "max_tokens": 0}, "max_tokens"),
    ({"prompt": ONCE, "n": 0}, "n"),
    ({"prompt": ONCE, "stop": [""]}, "stop"),
    ({"prompt": ONCE, "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": ONCE, "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": ONCE, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": ONCE, "frobnicate": 1}, "frobnicate"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": [1, 2, 999999]}, "prompt"),
    ({"prompt": ONCE * 200}, "prompt"),  # cannot fit: names max_seq_len
    ({"prompt": ONCE, "response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_completion_requests_are_400_naming_the_field(server, body, param):
    err = check_error(httpx.post(server.url + "/v1/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"
    if body.get("prompt") == ONCE * 200:
        assert "max_seq_len=512" in err["message"]


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "messages"),  # roles out of order
])
def test_bad_chat_requests_are_400(server, messages, param):
    check_error(httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}), 400, param)


def test_bad_json_unknown_model_and_route(server):
    check_error(httpx.post(server.url + "/v1/completions", content=b"{not json"), 400)
    err = check_error(httpx.post(server.url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    check_error(httpx.get(server.url + "/v1/nothing"), 404)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="stories", prompt="x", temperature=7)
    assert "temperature" in str(e.value)


def test_queue_full_is_429_and_disconnect_frees_the_slots(server):
    """BATCH slots + QUEUE waiting: a request that would exceed them gets 429 with Retry-After; a client that
    disconnects cancels its sequences at once, so the next request is admitted."""
    long = {"model": "stories", "prompt": ONCE, "max_tokens": 480, "temperature": 1.0, "seed": 1,
            "logit_bias": NO_EOS, "stream": True, "n": BATCH + QUEUE}
    aborted = metric(server, 'llama_sequences_finished_total{reason="abort"}')
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/completions", json=long) as resp:
            assert resp.status_code == 200
            events = sse_events(resp)  # kept referenced: closing it would close the connection
            next(events)  # generating now
            busy = h.post(server.url + "/v1/completions", json={"prompt": ONCE, "max_tokens": 4})
            err = check_error(busy, 429)
            assert err["type"] == "rate_limit_error" and busy.headers["retry-after"] == "1"
            with pytest.raises(openai.RateLimitError):
                server.client().completions.create(model="stories", prompt=ONCE, max_tokens=4)
        # the stream is closed here: the server cancels its sequences at its next step
        deadline = time.time() + 5
        while metric(server, "llama_requests_running") + metric(server, "llama_requests_waiting") > 0:
            assert time.time() < deadline, "the disconnected request still holds its slots"
            time.sleep(0.02)
        ok = h.post(server.url + "/v1/completions", json={"prompt": ONCE, "max_tokens": 4, "n": BATCH + QUEUE})
        assert ok.status_code == 200, ok.text
    assert metric(server, 'llama_sequences_finished_total{reason="abort"}') == aborted + BATCH + QUEUE


@pytest.fixture
def gated():
    """The server in this process on stories260K, every request held after its first token until gate.open()."""
    from helpers import Gate, GatedServer, build_stories

    s = GatedServer(build_stories(max_batch_size=BATCH, max_seq_len=MAX_SEQ_LEN), Gate(after=1))
    yield s
    s.close()


def test_non_streaming_disconnect_cancels(gated):
    """A client that gives up on a non-streaming request cancels its sequences. The gate holds generation, so the
    request cannot finish before the client's timeout however fast the machine is."""
    body = {"prompt": ONCE, "max_tokens": 480, "temperature": 1.0, "logit_bias": NO_EOS, "n": BATCH}
    aborted = metric(gated, 'llama_sequences_finished_total{reason="abort"}')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gated.url + "/v1/completions", json=body, timeout=0.5)
    deadline = time.time() + 30
    while len(gated.requests) < BATCH or not all(r.cancelled for r in gated.requests):
        assert time.time() < deadline, "the abandoned non-streaming request was not cancelled"
        time.sleep(0.02)
    assert not any(r.done() for r in gated.requests)  # cancelled while held, not finished
    gated.gate.open()
    while metric(gated, 'llama_sequences_finished_total{reason="abort"}') < aborted + BATCH:
        assert time.time() < deadline, "the cancelled sequences did not end as aborted"
        time.sleep(0.02)
    assert metric(gated, "llama_requests_running") == 0
    assert all(r.tokens_generated < 480 for r in gated.requests)


def test_too_many_sequences_for_the_server_is_400(server):
    check_error(httpx.post(server.url + "/v1/completions", json={"prompt": ONCE, "n": BATCH + QUEUE + 1}), 400, "n")


# ------------------------------------------------------------------------------------------- API keys
@pytest.fixture(scope="module")
def keyed():
    s = Server(need(STORIES), "--max_seq_len", "128", "--max_batch_size", "2", "--api-key", "sekrit",
               "--api-key", "other-key")
    yield s
    s.close()


def test_api_key_enforced(keyed):
    with pytest.raises(openai.AuthenticationError) as e:
        keyed.client(api_key="wrong").completions.create(model="stories260K", prompt=ONCE, max_tokens=2)
    assert e.value.status_code == 401
    err = check_error(httpx.post(keyed.url + "/v1/completions", json={"prompt": ONCE}), 401)
    assert err["type"] == "authentication_error"
    check_error(httpx.get(keyed.url + "/v1/models"), 401)
    for key in ("sekrit", "other-key"):
        out = keyed.client(api_key=key).completions.create(model="stories260K", prompt=ONCE, max_tokens=2)
        assert out.choices[0].text
    assert httpx.get(keyed.url + "/health").status_code == 200  # health and metrics stay open
    assert httpx.get(keyed.url + "/metrics").status_code == 200


def test_chat_default_max_tokens_is_what_fits(keyed):
    out = keyed.client(api_key="sekrit").chat.completions.create(model="stories260K", messages=CHAT, temperature=0)
    assert out.usage.completion_tokens > 16  # completions default to 16; chat runs to the end of the cache
    if out.choices[0].finish_reason == "length":
        assert out.usage.total_tokens == 128


def test_response_format_json_schema_and_object(server):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 10},
                             "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
    c = server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    out = c.chat.completions.create(model="stories", messages=CHAT, temperature=1.0, seed=3, n=3, max_tokens=80,
                                    response_format=rf)
    for ch in out.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), schema)
    streamed = c.completions.create(model="stories", prompt=ONCE, temperature=1.0, seed=4, max_tokens=80, stream=True,
                                    extra_body={"response_format": rf})
    jsonschema.validate(json.loads("".join(ch.choices[0].text for ch in streamed)), schema)
    # stories260K never closes a string by itself: a bias toward '"', ':' and '}' (436, 467, 128; the grammar masks
    # them where invalid) lets it finish an object within the budget (tests/serve/test_serve_grammar.py)
    obj = c.chat.completions.create(model="stories", messages=CHAT, temperature=0, max_tokens=30,
                                    response_format={"type": "json_object"},
                                    logit_bias={"436": 5, "467": 5, "128": 20})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict), obj.choices[0].message.content
    bad = httpx.post(server.url + "/v1/chat/completions",
                     json={"messages": CHAT, "response_format": {"type": "json_schema",
                                                                 "json_schema": {"schema": {"type": "nonsense"}}}})
    check_error(bad, 400, "response_format")


def test_model_parallel_rank0_serves(tmp_path, local):
    """Under torchrun with 2 ranks (stories260K resharded in 2), rank 0 serves and rank 1 replays its steps: the
    same text as one process, and a clean shutdown releases both."""
    from llama.formats.reshard import reshard

    reshard(need(STORIES), tmp_path / "two", 2)
    s = Server(tmp_path / "two", "--max_seq_len", str(MAX_SEQ_LEN), "--max_batch_size", "2",
               tokenizer=STORIES / "tokenizer.model", nproc=2)
    try:
        c = s.client()
        out = c.completions.create(model="two", prompt=[ONCE, "Lily"], max_tokens=24, temperature=0.8, seed=3)
        ref = local.text_completion([ONCE, "Lily"], temperature=0.8, top_p=1.0, max_gen_len=24, seed=3)
        assert [ch.text for ch in out.choices] == [r["generation"] for r in ref]
        streamed = c.chat.completions.create(model="two", messages=CHAT, max_tokens=16, temperature=0, stream=True)
        ref_chat = local.chat_completion([CHAT], temperature=0, max_gen_len=16)[0]["generation"]["content"]
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == ref_chat
    finally:
        s.close()
    assert s.proc.returncode is not None


def test_without_ckpt_dir_it_serves_the_default_model_and_says_so(tmp_path):
    """`python -m llama.serve` with no --ckpt_dir serves SmolLM2-135M-Instruct from the cache the examples fill
    (here laid from ../shared, so nothing is fetched), names it in one line, and answers as the Python API does on
    the same file."""
    from conftest import SHARED, fresh_cache

    from llama import Llama
    from llama.hub import fetch

    gguf = need(SHARED / "models/smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    cached = fresh_cache(tmp_path) / "smollm2-135m-instruct" / gguf.name
    cached.parent.mkdir()
    cached.symlink_to(gguf)
    s = Server(None, "--max_seq_len", "256", "--max_batch_size", "2", env={"LLAMA_CACHE": str(tmp_path)})
    try:
        client = s.client()
        assert [m.id for m in client.models.list().data] == [fetch.NAME]
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model=fetch.NAME, max_tokens=16, temperature=0, messages=question)
        local = Llama.build(str(gguf), None, 256, 1, compile=False)
        assert reply.choices[0].message.content == local.chat_completion(
            [question], max_gen_len=16, temperature=0)[0]["generation"]["content"]
    finally:
        s.close()
    out = s.proc.stdout.read()
    assert [line for line in out.splitlines() if line.startswith("Using ")] == [fetch.NOTE]
