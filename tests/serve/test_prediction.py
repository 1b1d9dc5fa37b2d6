"""Predicted outputs (OpenAI's `prediction`, SamplingParams.prediction): the predicted text's tokens are a draft
source (llama/core/speculation/speculative.py), used without --speculative, so every output is token for token the output
without a prediction; usage counts the accepted and rejected prediction tokens; a bad prediction is a 400."""

import pytest
from conftest import CPU_SPECULATION, STORIES, need
from helpers import draft_tally

from llama import Llama
from llama.core.speculation import speculative

pytestmark = CPU_SPECULATION

MAX_SEQ_LEN = 256
PROMPT = "Lily and Ben went to the park. Lily and Ben"
CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module", autouse=True)
def untimed():
    """Drafts decided by the tokens alone, not by step times on a busy machine: the counts asserted are the same
    every run (set before the generator is built: its speculators' memory reads it)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(speculative, "MEASURE", False)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def gen():
    """stories260K, eager and without speculative=: predictions alone draft."""
    d = need(STORIES)
    return Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=MAX_SEQ_LEN, max_batch_size=4, compile=False,
                       prefix_cache="off")  # a cached prompt position rounds unlike a computed one


@pytest.fixture()
def tally(monkeypatch):
    return draft_tally(monkeypatch.setattr)


def edited(text: str) -> str:
    """The text with a sentence changed in the middle and its end cut: drafts that miss, then match again."""
    words = text.split(" ")
    return " ".join(words[:8] + ["the", "dog", "ran", "home."] + words[10:-6])


@pytest.mark.parametrize("opts", [dict(temperature=0, logprobs=True),
                                  dict(temperature=0.8, top_p=0.95, seed=5, n=2, logprobs=True, top_logprobs=2),
                                  dict(temperature=1.0, seed=9, stop=["."], repetition_penalty=1.1)],
                         ids=["greedy", "seeded-n2", "seeded-stop"])
def test_outputs_with_a_prediction_are_the_outputs_without(gen, tally, opts):
    want = gen.text_completion([PROMPT], max_gen_len=120, **opts)
    text = want[0]["generation"]
    for prediction in (text, edited(text), "Once upon a time there was a big red ball.", ""):
        assert gen.text_completion([PROMPT], max_gen_len=120, prediction=prediction, **opts) == want, prediction
    assert tally["accepted"] > 20, tally


def test_chat_and_the_engine_count_accepted_tokens(gen, tally):
    want = gen.chat_completion([CHAT], temperature=0, max_gen_len=80)[0]
    reply = want["generation"]["content"]
    assert gen.chat_completion([CHAT], temperature=0, max_gen_len=80, prediction=reply)[0] == want
    engine = gen.engine()
    try:
        echo = engine.submit(CHAT, temperature=0, max_gen_len=80, prediction=reply)
        none = engine.submit(CHAT, temperature=0, max_gen_len=80)
        assert echo.result(timeout=60) == none.result(timeout=60) == want
    finally:
        engine.close()
    assert echo.accepted > 0.5 * len(echo.generated), (echo.accepted, len(echo.generated))
    assert echo.drafted >= echo.accepted and none.drafted == 0


def test_bad_predictions_are_refused(gen):
    with pytest.raises(ValueError, match="prediction must be a string"):
        gen.text_completion([PROMPT], prediction=5)
    with pytest.raises(ValueError, match="prediction has .* tokens; it must have at most max_seq_len=256"):
        gen.text_completion([PROMPT], prediction="the cat " * 200)


# ------------------------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def server():
    pytest.importorskip("openai", reason="the server tests need the openai client: pip install -e '.[test]'")
    pytest.importorskip("uvicorn", reason="the server needs the serve extra: pip install -e '.[serve]'")
    from serve_util import Server

    s = Server(need(STORIES), "--max_seq_len", str(MAX_SEQ_LEN), "--max_batch_size", "4", "--model-name", "stories")
    yield s
    s.close()


def test_the_openai_client_sends_a_prediction_and_gets_its_usage(server, gen):
    c = server.client()
    want = gen.chat_completion([CHAT], temperature=0, max_gen_len=80)[0]["generation"]["content"]
    plain = c.chat.completions.create(model="stories", messages=CHAT, max_tokens=80, temperature=0)
    assert plain.choices[0].message.content == want
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    for content in (want, [{"type": "text", "text": want[:20]}, {"type": "text", "text": want[20:]}]):
        out = c.chat.completions.create(model="stories", messages=CHAT, max_tokens=80, temperature=0,
                                        prediction={"type": "content", "content": content})
        assert out.choices[0].message.content == want
        details = out.usage.completion_tokens_details
        # the server times its steps: how much is drafted depends on the machine, that something is accepted not
        assert 0 < details.accepted_prediction_tokens <= out.usage.completion_tokens
        assert details.rejected_prediction_tokens >= 0

    ref = gen.text_completion([PROMPT], temperature=0.7, seed=3, max_gen_len=60)[0]["generation"]
    chunks = list(c.completions.create(model="stories", prompt=PROMPT, max_tokens=60, temperature=0.7, seed=3,
                                       top_p=0.9, stream=True, stream_options={"include_usage": True},
                                       extra_body={"prediction": {"type": "content", "content": edited(ref)}}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref
    details = chunks[-1].usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0, details


@pytest.mark.parametrize("prediction, param", [
    ("the text", "prediction"),
    ({"type": "text", "content": "x"}, "prediction"),
    ({"type": "content"}, "prediction"),
    ({"type": "content", "content": "x", "extra": 1}, "prediction"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "prediction.content[0]"),
    ({"type": "content", "content": "x" * (32 * MAX_SEQ_LEN + 1)}, "prediction.content"),
    ({"type": "content", "content": "the cat " * 200}, "prediction"),  # over max_seq_len tokens
])
def test_bad_predictions_are_400s_naming_the_field(server, prediction, param):
    import httpx

    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": PROMPT})):
        resp = httpx.post(server.url + path, json={**body, "max_tokens": 4, "prediction": prediction}, timeout=60)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and "prediction" in err["message"], err
