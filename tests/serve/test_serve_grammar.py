"""Structured outputs (llama/sample/grammar.py): every output that finishes parses as JSON and validates against its
schema, on stories260K and on random models with the real Llama 2 (32000) and Llama 3 (128256) vocabularies,
through text, chat, streams and the engine."""

import json

import pytest
from conftest import SHARED, need

pytest.importorskip("llguidance", reason="structured outputs need llguidance: pip install -e '.[serve]'")
jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[test]'")

from llama import Grammar  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "enum": ["cat", "dog", "fish"]}}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["user", "score", "ok"],
          "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
                                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                 "tags": {"type": "array", "minItems": 1, "maxItems": 2,
                                                          "items": {"type": "string", "maxLength": 5}}}},
                         "score": {"type": "number", "minimum": 0, "maximum": 1},
                         "ok": {"type": "boolean"}}}
CHOICE = {"type": "object", "additionalProperties": False, "required": ["color"],
          "properties": {"color": {"enum": ["red", "green", "blue"]}}}
SCHEMAS = [PERSON, NESTED, CHOICE]


def check(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "nested", "enum"])
def test_text_completion_outputs_validate(stories, schema):
    out = stories.text_completion(["Once upon a time"] * 2, temperature=1.0, top_p=1.0, max_gen_len=120, n=2,
                                  seed=[1, 2], grammar={"json_schema": schema})
    for pred in out:
        check(pred["generation"], schema)


def test_chat_stream_and_engine(stories):
    dialog = [{"role": "user", "content": "Describe a person"}]
    chat = stories.chat_completion([dialog], temperature=0.9, max_gen_len=120, seed=4, grammar={"json_schema": PERSON})
    check(chat[0]["generation"]["content"], PERSON)
    streamed = "".join(stories.stream_completion("Lily", temperature=0.9, max_gen_len=120, seed=5,
                                                 grammar=Grammar.json_schema(NESTED)))
    check(streamed, NESTED)
    email = "".join(stories.stream_chat(dialog, temperature=1.0, seed=6, max_gen_len=40,
                                        grammar={"regex": "[a-z]{3,8}@example\\.com"}))
    assert email.endswith("@example.com") and 3 <= len(email.split("@")[0]) <= 8
    with stories.engine() as engine:
        reqs = [engine.submit("Once", temperature=1.0, seed=s, max_gen_len=120, grammar={"json_schema": schema})
                for s, schema in enumerate(SCHEMAS)]
        for r, schema in zip(reqs, SCHEMAS):
            check(r.result()["generation"], schema)
            assert r.finish_reason == "stop"


# stories260K never closes a string on its own (greedy or sampled, it writes a story inside the first key until the
# length limit). A bias toward '"' and ':' and a larger one toward '}' (byte token <0x7D>), which the grammar masks
# wherever they are invalid, lets it finish an object; without the grammar the same bias writes no JSON at all.
CLOSING_BIAS = {436: 5.0, 467: 5.0, 128: 20.0}  # '"', ':', '}' in stories260K's vocabulary


def closing_bias(ids, logits):
    logits = logits.clone()
    for tok, b in CLOSING_BIAS.items():
        logits[tok] += b
    return logits


def test_json_object_output_parses(stories):
    out = stories.text_completion(["{"], temperature=0, max_gen_len=60, grammar={"json_object": True},
                                  logits_processors=[closing_bias])
    text = out[0]["generation"]
    assert isinstance(json.loads(text), dict), text
    dialog = [{"role": "user", "content": "A story about a cat"}]
    chat = stories.chat_completion([dialog], temperature=0, max_gen_len=30, grammar=Grammar.json_object(),
                                   logits_processors=[closing_bias])
    assert isinstance(json.loads(chat[0]["generation"]["content"]), dict), chat[0]["generation"]["content"]


def test_bad_grammars_are_value_errors(stories):
    with pytest.raises(ValueError, match="grammar"):
        stories.text_completion(["x"], grammar={"regex": "("})
    with pytest.raises(ValueError, match="grammar"):
        stories.text_completion(["x"], grammar={"json_schema": "{not json"})
    with pytest.raises(ValueError, match="grammar must be"):
        stories.text_completion(["x"], grammar=42)
    with stories.engine() as engine:
        with pytest.raises(ValueError, match="grammar"):
            engine.submit("x", grammar={"regex": "("}).result()


def test_random_llama2_vocabulary(rand_gen):
    out = rand_gen.text_completion(["Hello"] * 3, temperature=1.0, max_gen_len=100, seed=[1, 2, 3],
                                   grammar={"json_schema": PERSON})
    for pred in out:
        check(pred["generation"], PERSON)


@pytest.fixture(scope="module")
def rand_llama3(tmp_path_factory):
    from llama import Llama
    from llama.hub.demo import write_random_checkpoint

    tokenizer = need(SHARED / "tokenizers" / "llama3" / "tokenizer.model")
    d = tmp_path_factory.mktemp("rand_llama3")
    params = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "multiple_of": 32, "norm_eps": 1e-5,
              "vocab_size": 128256, "rope_theta": 500000.0}
    write_random_checkpoint(d, params, tokenizer_path=tokenizer, std=0.5)
    return Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=128, max_batch_size=2)


def test_random_llama3_vocabulary(rand_llama3):
    out = rand_llama3.text_completion(["Hello"], temperature=1.0, max_gen_len=60, seed=[7], n=2,
                                      grammar={"json_schema": CHOICE})
    for pred in out:
        check(pred["generation"], CHOICE)
