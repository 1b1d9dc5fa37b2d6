"""Faults behind the server (llama/serve/app.py), in this process so they can be injected: a request that fails
in the middle of its stream, and an engine whose thread dies. The app runs under a real uvicorn on 127.0.0.1 and
is driven by the official `openai` client."""

import threading
import time

import pytest
from conftest import STORIES, need

openai = pytest.importorskip("openai", reason="the server tests need the openai client: pip install -e '.[test]'")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn", reason="the server needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("starlette", reason="the server needs the serve extra: pip install -e '.[serve]'")

from serve_util import free_port  # noqa: E402

ONCE = "Once upon a time"
FAIL_SEED = 666  # requests with this seed get a logits processor that raises after a few tokens
NO_EOS = {"2": -100}


def failing_after(n):
    def processor(generated, logits):
        if len(generated) >= n:
            raise ValueError("the injected fault")
        return logits

    return processor


class InProcessServer:
    """create_app over a stories260K Llama whose engine lets a test inject faults, served by uvicorn in a thread."""

    def __init__(self):
        from llama import Llama
        from llama.serve.app import create_app

        d = need(STORIES)
        self.gen = Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=256, max_batch_size=4, compile=False)
        self.engine = None
        make_engine = self.gen.engine

        def engine(**kw):
            self.engine = make_engine(**kw)
            submit = self.engine.submit_samples

            def submit_samples(prompt, n, **params):
                if params.get("seed") == FAIL_SEED:
                    params["logits_processors"] = [failing_after(5)]
                return submit(prompt, n, **params)

            self.engine.submit_samples = submit_samples
            return self.engine

        self.gen.engine = engine
        app = create_app(lambda: self.gen, "stories")
        self.url = f"http://127.0.0.1:{free_port()}"
        config = uvicorn.Config(app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the in-process server did not become healthy"
            time.sleep(0.05)

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server():
    s = InProcessServer()
    yield s
    s.close()


def test_an_error_mid_stream_is_an_error_event_and_others_go_on(server):
    """A request that fails after some tokens: its stream has those deltas, then a `data: {"error": ...}` event
    (the openai client raises it) and no [DONE]; a stream running beside it is unaffected."""
    c = server.client()
    good_ref = server.gen.text_completion([ONCE], temperature=0.8, top_p=1.0, seed=5, max_gen_len=60)[0]["generation"]
    good = c.completions.create(model="stories", prompt=ONCE, max_tokens=60, temperature=0.8, seed=5, stream=True)
    first = next(good).choices[0].text
    bad = c.completions.create(model="stories", prompt="The little dog", max_tokens=60, temperature=0.8,
                               seed=FAIL_SEED, stream=True)
    got = []
    with pytest.raises(openai.APIError, match="the injected fault") as e:
        for ch in bad:
            got.append(ch.choices[0].text)
    assert "".join(got)  # some text came before the error
    assert e.value.body["code"] == "invalid_value"
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"prompt": "Tom had", "max_tokens": 40, "seed": FAIL_SEED, "stream": True}) as raw:
        events = [line[6:] for line in raw.iter_lines() if line.startswith("data: ")]
    assert '"error"' in events[-1] and "[DONE]" not in events
    assert first + "".join(ch.choices[0].text for ch in good) == good_ref
    whole = httpx.post(server.url + "/v1/completions", json={"prompt": ONCE, "max_tokens": 40, "seed": FAIL_SEED})
    assert whole.status_code == 400 and "the injected fault" in whole.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_when_the_engine_dies_streams_end_with_an_error_and_health_is_503(server):
    """Runs last in this module (it kills the engine): open streams get an error event, a non-streaming request
    in flight a 503, /health turns 503 and new requests get 503 naming the cause."""
    c = server.client()
    stream = c.completions.create(model="stories", prompt=ONCE, max_tokens=200, temperature=1.0, seed=1,
                                  stream=True, extra_body={"logit_bias": NO_EOS})
    next(stream)
    result = {}

    def whole():
        result["resp"] = httpx.post(server.url + "/v1/completions", timeout=60,
                                    json={"prompt": "Lily", "max_tokens": 200, "logit_bias": NO_EOS})

    waiter = threading.Thread(target=whole)
    waiter.start()
    deadline = time.time() + 30
    while sum(r is not None for r in server.engine.slots) < 2:
        assert time.time() < deadline, "the second request was not admitted"
        time.sleep(0.01)

    def broken_plan():
        raise RuntimeError("lost the model-parallel peer")

    server.engine.scheduler.plan = broken_plan
    with pytest.raises(openai.APIError, match="lost the model-parallel peer"):
        for _ in stream:
            pass
    waiter.join(30)
    resp = result["resp"]
    assert resp.status_code == 503 and "lost the model-parallel peer" in resp.json()["error"]["message"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stopped"
    late = httpx.post(server.url + "/v1/completions", json={"prompt": ONCE, "max_tokens": 4})
    assert late.status_code == 503 and "lost the model-parallel peer" in late.json()["error"]["message"]
