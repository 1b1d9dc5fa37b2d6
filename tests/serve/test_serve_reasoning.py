"""A reasoning model's <think> block: returned as `reasoning_content` on /v1/chat/completions (whole and streamed
as delta.reasoning_content chunks before the content), kept in the text of the Python API unless
split_reasoning=True. The model is the shared SmolLM2 with DeepSeek-R1-Distill-Llama's real template (its
generation prompt opens `<think>\\n`), its reply forced token by token."""

import json

import helpers
import peers
import pytest
from conftest import SHARED, need
from helpers import ready_client

from llama import Llama

GGUF = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
REPLY = "The user wants 12345 + 1.\nAdd one.\n</think>\n\nIt is 12346."
DIALOG = [{"role": "user", "content": "What is 12345 + 1?"}]


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    """SmolLM2's weights and vocabulary, with the R1 distill's chat template (a tokenizer.json beside it)."""
    pytest.importorskip("gguf", reason="the gguf package reads GGUF files")
    from llama.formats.gguf_file import open_reader
    from llama.tokenizers import huggingface
    d = tmp_path_factory.mktemp("r1")
    tok = huggingface.from_gguf(open_reader(need(GGUF)), GGUF)
    tok.tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": peers.template("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja")}))
    return Llama.build(str(GGUF), str(d / "tokenizer.json"), max_seq_len=256, max_batch_size=2, compile=False)


def forcing(tokenizer, text):
    """helpers.forcing of text's tokens."""
    return helpers.forcing(tokenizer.encode(text, bos=False, eos=False), tokenizer.eos_id)


def test_the_python_api_keeps_the_block_unless_asked(r1):
    force = forcing(r1.tokenizer, REPLY)
    kept = r1.chat_completion([DIALOG], logits_processors=[force], max_gen_len=64)[0]["generation"]
    assert kept["content"] == REPLY and "reasoning_content" not in kept
    split = r1.chat_completion([DIALOG], logits_processors=[force], max_gen_len=64, split_reasoning=True)[0]
    assert split["generation"]["reasoning_content"] == "The user wants 12345 + 1.\nAdd one."
    assert split["generation"]["content"] == "It is 12346."
    assert r1.inputs.encode_dialog(DIALOG)[0][-3:] == r1.tokenizer.encode("<think>\n", bos=False, eos=False)[-3:]


def test_the_server_returns_reasoning_content_whole_and_streamed(r1):
    pytest.importorskip("starlette", reason="the server needs the serve extra: pip install -e '.[serve]'")
    pytest.importorskip("httpx")

    from llama.serve.app import create_app

    app = create_app(lambda: r1, "r1")
    force = forcing(r1.tokenizer, REPLY)
    with ready_client(app) as client:
        engine = app.state.llama.engine
        submit = engine.submit_samples
        engine.submit_samples = lambda p, n, **kw: submit(p, n, **kw, logits_processors=[force])
        body = {"model": "r1", "messages": DIALOG, "max_tokens": 64}
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "reasoning_content": "The user wants 12345 + 1.\nAdd one.",
                           "content": "It is 12346."}
        r = client.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        thought = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        assert (thought, content) == (message["reasoning_content"], message["content"])
        kinds = [k for d in deltas for k in d if k in ("reasoning_content", "content") and d[k]]
        assert kinds == sorted(kinds, reverse=True) and len(kinds) > 4  # every reasoning chunk before the content
        completion = client.post("/v1/completions", json={"model": "r1", "prompt": "Hi", "max_tokens": 8}).json()
        assert "reasoning_content" not in completion["choices"][0]
