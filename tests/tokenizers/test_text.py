"""Unencodable text (an unpaired surrogate: legal in JSON and in a Python str, but not Unicode text) is refused on
every path with a ValueError, or the server's 400, that names the field; nothing already running is disturbed."""

import json

import pytest
from helpers import ready_client

from llama.sample.grammar import Grammar
from llama.tokenizers.text import check_text

LONE = "a\ud800b"


def test_check_text_names_the_field_and_the_character():
    for good in ("", "plain", "日本語 ünïcödé", "emoji 🦙 (a surrogate pair in UTF-16, one character here)"):
        assert check_text("prompt", good) == good
    for bad, index, code in ((LONE, 1, "D800"), ("\udfff", 0, "DFFF"), ("ok \udc80", 3, "DC80")):
        with pytest.raises(ValueError, match=rf"^my field is not valid text: character {index} is U\+{code}"):
            check_text("my field", bad)


def test_every_python_path_refuses_unpaired_surrogates_by_field(stories):
    refusals = {
        "prompt": lambda: stories.text_completion([LONE], max_gen_len=2),
        r"dialog 0, message 1: content": lambda: stories.chat_completion(
            [[{"role": "system", "content": "s"}, {"role": "user", "content": LONE}]], max_gen_len=2),
        r"stop\[1\]": lambda: stories.text_completion(["Once"], max_gen_len=2, stop=["x", LONE]),
        "text 1": lambda: stories.score(["Once upon a time", LONE]),
        "text": lambda: stories.tokenizer.encode(LONE, bos=True, eos=False),
        "grammar: the regex": lambda: Grammar.regex(LONE),
        "prompt ": lambda: list(stories.stream_completion(LONE, max_gen_len=2)),
    }
    for field, call in refusals.items():
        with pytest.raises(ValueError, match=f"^{field}.*not valid text"):
            call()
    with stories.engine() as engine:
        refused = engine.submit(LONE, max_gen_len=2)  # the engine answers with a failed request, not a raise
        with pytest.raises(ValueError, match="^prompt is not valid text"):
            refused.result(timeout=60)
        ok = engine.submit("Once upon a time", max_gen_len=4, temperature=0).result(timeout=60)
    assert ok == stories.text_completion(["Once upon a time"], max_gen_len=4, temperature=0)[0]


def test_the_server_answers_400_naming_the_field(stories):
    pytest.importorskip("starlette", reason="the server needs the serve extra: pip install -e '.[serve]'")
    pytest.importorskip("httpx")

    from llama.serve.app import create_app

    bad = {
        "/v1/completions": [{"prompt": LONE}, {"prompt": "Once", "stop": [LONE]}],
        "/v1/chat/completions": [{"messages": [{"role": "user", "content": LONE}]}],
    }
    with ready_client(create_app(lambda: stories, "stories")) as client:
        for path, bodies in bad.items():
            for body in bodies:
                # json.dumps escapes the surrogate as \ud800: valid JSON, as a client would send it
                payload = json.dumps({"model": "stories", "max_tokens": 2, **body})
                r = client.post(path, content=payload, headers={"content-type": "application/json"})
                assert r.status_code == 400, (path, body, r.text)
                message = r.json()["error"]["message"]
                assert "not valid text" in message and "U+D800" in message, message
        r = client.post("/v1/completions", json={"model": "stories", "prompt": "Once", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
