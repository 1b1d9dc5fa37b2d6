"""/tokenize, /detokenize and /v1/models/{id}: the shapes of llama.cpp's and vLLM's servers, the model's own
tokenizer and chat template, and OpenAI-shaped 4xx errors for bad input."""

import json

import pytest
from helpers import ready_client

pytest.importorskip("starlette", reason="the server needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def client(stories):

    from llama.serve.app import create_app

    with ready_client(create_app(lambda: stories, "stories")) as c:
        yield c


def test_tokenize_and_detokenize_round_trip_with_the_models_tokenizer(client, stories):
    text = "Once upon a time, there was a llama."
    ids = stories.tokenizer.encode(text, bos=True, eos=False)
    for body in ({"content": text}, {"model": "stories", "prompt": text}):  # llama.cpp's field, vLLM's
        r = client.post("/tokenize", json=body)
        assert r.status_code == 200 and r.json() == {"tokens": ids, "count": len(ids), "max_model_len": 256}
    r = client.post("/tokenize", json={"content": text, "add_special": False, "with_pieces": True}).json()
    assert r["tokens"] == ids[1:] and "".join(r["pieces"]).replace(" ", "") == text.replace(" ", "")
    assert client.post("/detokenize", json={"tokens": ids}).json()["content"] == text


def test_tokenize_renders_a_chat_as_the_server_would(client, stories):
    dialog = [{"role": "user", "content": "Hello"}]
    want, _ = stories.inputs.encode_dialog(dialog)
    assert client.post("/tokenize", json={"messages": dialog}).json()["tokens"] == want


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/tokenize", {"content": "a\ud800"}, "content"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", [1, 2], "tokens"),
])
def test_bad_input_is_a_400_in_openais_shape(client, path, body, param):
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_models_by_id(client):
    r = client.get("/v1/models/stories")
    assert r.status_code == 200 and r.json()["id"] == "stories" and r.json()["max_model_len"] == 256
    assert r.json() == client.get("/v1/models").json()["data"][0]
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
