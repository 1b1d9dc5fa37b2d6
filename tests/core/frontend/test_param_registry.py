"""Sampling parameters declared once (llama/core/frontend/param_registry.py): a parameter registered by this test alone, with
no other file touched, works through the Python API, the server, the batch CLI and the draft model, changes the
output, and is refused with a clear error (HTTP 400 in the server) when its value is bad; unregistered, it is
unknown everywhere again. Plus the declaration's own rules: bounds wording, wire bounds, what register refuses."""

import json
import math

import pytest
import torch
from conftest import CPU_SPECULATION, STORIES, need
from helpers import ONCE, draft_tally, ready_client

from llama.core.frontend.params import Param, SamplingParams, Wire, names, register, unregister

BAN = "ban_token"
GREEDY = dict(temperature=0, max_gen_len=40)


def ban(row, prompt, generated, p):
    """The test parameter's transform: the banned token can never be sampled."""
    row[p.ban_token] = float("-inf")


@pytest.fixture
def ban_token():
    param = register(Param(BAN, int, None, lo=0, hint="(a token id)", wire=Wire(), transform=ban))
    try:
        yield param
    finally:
        unregister(BAN)


@pytest.fixture(scope="module")
def banned(goldens):
    return goldens[ONCE]["generated_tokens"][0]  # the greedy first token, frequent in the golden text


def recorder(seen):
    """A logits processor that records the tokens generated so far (it runs before the transforms)."""
    def record(ids, logits):
        seen.append(list(ids))
        return logits
    return record


def serve(stories):
    pytest.importorskip("starlette", reason="the server needs the serve extra: pip install -e '.[serve]'")
    pytest.importorskip("httpx")

    from llama.serve.app import create_app

    return ready_client(create_app(lambda: stories, "stories"))


# --------------------------------------------------------------------------------------------- the three paths
def test_registered_parameter_through_the_python_api(stories, ban_token, banned):
    free = stories.text_completion([ONCE], **GREEDY)[0]["generation"]
    seen = []
    got = stories.text_completion([ONCE], **GREEDY, ban_token=banned, logits_processors=[recorder(seen)])
    assert got[0]["generation"] != free
    assert len(seen) == 40 and all(banned not in s for s in seen)
    assert stories.text_completion([ONCE], **GREEDY, ban_token=None)[0]["generation"] == free  # None: unset
    assert SamplingParams(ban_token=banned).transforms == (ban,)
    assert SamplingParams(ban_token=3, presence_penalty=0.5).transforms[1] is ban  # penalties first: declared first
    for value, msg in ((-1, "ban_token must be >= 0 \\(a token id\\), got -1"), (1.5, "ban_token must be an integer"),
                       ("3", "ban_token must be an integer")):
        with pytest.raises(ValueError, match=msg):
            stories.text_completion([ONCE], **GREEDY, ban_token=value)
        with pytest.raises(ValueError, match=msg):
            stories.stream_completion(ONCE, **GREEDY, ban_token=value)


def test_registered_parameter_through_the_server(stories, ban_token, banned):
    body = {"prompt": ONCE, "max_tokens": 40, "temperature": 0}
    with serve(stories) as client:
        free = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        out = client.post("/v1/completions", json={**body, BAN: banned})
        assert out.status_code == 200, out.text
        text = out.json()["choices"][0]["text"]
        assert text != free
        assert text == stories.text_completion([ONCE], **GREEDY, ban_token=banned)[0]["generation"]
        dialog = [{"role": "user", "content": "Tell me a story"}]
        first = stories.generate([stories.inputs.encode_dialog(dialog)[0]], 1, temperature=0)[0][0][0]
        chat = {"messages": dialog, "max_tokens": 30, "temperature": 0}
        chats = [client.post("/v1/chat/completions", json=b).json()["choices"][0]["message"]["content"]
                 for b in (chat, {**chat, BAN: first})]  # the reply's first token banned
        assert chats[0] != chats[1]
        for value, message in ((-1, "ban_token must be >= 0, got -1"), ("x", "ban_token must be an integer, got 'x'"),
                               (True, "ban_token must be an integer, got True")):
            r = client.post("/v1/completions", json={**body, BAN: value})
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": BAN,
                                         "code": "invalid_value"}


def test_registered_parameter_through_the_batch_cli(tmp_path, ban_token, banned, stories):
    from llama.cli.batch import main

    d = need(STORIES)
    rows = [{"id": "free", "prompt": ONCE, **GREEDY}, {"id": "banned", "prompt": ONCE, **GREEDY, BAN: banned},
            {"id": "bad", "prompt": ONCE, **GREEDY, BAN: -1}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    threads = torch.get_num_threads()
    try:
        assert main(["--ckpt_dir", str(d), "--tokenizer_path", str(d / "tokenizer.model"), "--max_seq_len", "192",
                     "--max_batch_size", "4", "--threads", "1", "--no_progress", "--input", str(tmp_path / "in.jsonl"),
                     "--output", str(tmp_path / "out.jsonl")]) == 0
    finally:
        torch.set_num_threads(threads)
    out = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert out["banned"]["generation"] != out["free"]["generation"]
    assert out["banned"]["generation"] == stories.text_completion([ONCE], **GREEDY, ban_token=banned)[0]["generation"]
    assert "ban_token must be >= 0 (a token id), got -1" in out["bad"]["error"]


@CPU_SPECULATION
def test_registered_parameter_in_the_draft_models_picks(ban_token, banned, monkeypatch):
    """A model drafting for itself accepts every seeded token only if its picks see the transform too: a drafted
    banned token would be rejected."""
    from llama import Llama
    from llama.core.speculation import speculative

    monkeypatch.setattr(speculative, "MEASURE", False)
    tally = draft_tally(monkeypatch.setattr)
    d = str(need(STORIES))
    build = lambda draft: Llama.build(d, d + "/tokenizer.model", max_seq_len=256, max_batch_size=4, compile=False,
                                      prefix_cache="off", draft_model=draft)
    off, on = build(None), build(d)
    opts = dict(temperature=1.0, seed=5, max_gen_len=60)
    free = off.text_completion([ONCE], **opts)
    got = on.text_completion([ONCE], **opts, ban_token=banned)
    assert got == off.text_completion([ONCE], **opts, ban_token=banned) and got != free
    assert tally["drafted"] > 30 and tally["accepted"] == tally["drafted"], dict(tally)


def test_unregistered_parameter_is_unknown_everywhere(stories):
    assert BAN not in names()
    with pytest.raises(TypeError, match=BAN):
        SamplingParams(ban_token=3)
    with pytest.raises(TypeError, match=BAN):
        stories.text_completion([ONCE], ban_token=3)
    with serve(stories) as client:
        r = client.post("/v1/completions", json={"prompt": ONCE, BAN: 3})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    from llama.cli.batch import request_of

    with pytest.raises(ValueError, match=f"unknown field\\(s\\) {BAN}"):
        request_of({"id": 1, "prompt": ONCE, BAN: 3}, {}, 0)


# --------------------------------------------------------------------------------------------- declarations
@pytest.mark.parametrize("param, value, message", [
    (Param("p", float, 0.0, lo=0, hi=math.inf, hi_open=True), -1, "p must be >= 0 and finite, got -1"),
    (Param("p", float, 1.0, lo=0, hi=1, lo_open=True, hint="(x)"), 0, "p must be in (0, 1] (x), got 0"),
    (Param("p", float, 1.0, hi=1, hi_open=True), 1, "p must be < 1, got 1"),
    (Param("p", float, 1.0, lo=0, hi=1), float("nan"), "p must be in [0, 1], got nan"),
    (Param("p", int, None, lo=1), 0, "p must be >= 1, got 0"),
    (Param("p", int, 0, limit="be even"), True, "p must be an integer, got True"),
    (Param("p", bool, False), 1, "p must be True or False, got 1"),
])
def test_library_messages_name_the_parameter_and_the_limit(param, value, message):
    with pytest.raises(ValueError) as e:
        param.validate(value)
    assert str(e.value) == message


@pytest.mark.parametrize("param, value, message", [
    (Param("p", float, 0.0, lo=0, hi=math.inf, hi_open=True, wire=Wire(hi=2.0)), 3, "p must be in [0.0, 2.0], got 3"),
    (Param("p", float, 1.0, lo=0, hi=1, hi_open=True, wire=Wire()), 1, "p must be in [0.0, 1.0), got 1"),
    (Param("p", float, 1.0, wire=Wire()), float("inf"), "p must be a finite number, got inf"),
    (Param("p", int, None, lo=0, hi=8, hi_open=True, wire=Wire(field="q")), 8, "q must be in [0, 7], got 8"),
    (Param("p", bool, False, wire=Wire()), "yes", "p must be true or false, got 'yes'"),
])
def test_wire_messages_name_the_field_and_the_limit(param, value, message):
    with pytest.raises(ValueError) as e:
        param.from_wire({param.field: value})
    assert str(e.value) == message


def test_wire_defaults_and_reads():
    p = Param("p", int, 0, lo=0, wire=Wire(default=7, read=lambda v: 0 if v == -1 else v))
    assert (p.from_wire({}), p.from_wire({"p": None}), p.from_wire({"p": -1}), p.from_wire({"p": 3})) == (7, 7, 0, 3)
    f = Param("p", float, 0.5, wire=Wire())
    assert (f.from_wire({"p": 1}), f.from_wire({})) == (1.0, 0.5) and isinstance(f.from_wire({"p": 1}), float)


@pytest.mark.parametrize("param, message", [
    (Param("temperature", float, 1.0), "already registered"),
    (Param("with_", float, 1.0), "public identifier"),
    (Param("values", float, 1.0), "public identifier"),
    (Param("_p", float, 1.0), "public identifier"),
    (Param("p", None, (), wire=Wire()), "kind int, float or bool"),
    (Param("p", float, 1.0, wire=Wire(field="top_p")), "already another parameter's"),
])
def test_register_refuses_clashes(param, message):
    with pytest.raises(ValueError, match=message):
        register(param)
    assert "p" not in names()
