"""Tool-call grammars: forced, every family's call parses and its arguments match the schema even from a tiny
random-ish model; lazy, text is free until the trigger and the call is valid after it; never inside <think>."""

import json

import jsonschema
import pytest
import torch

from llama.sample.tool_grammar import ToolGrammar
from llama.tokenizers.tool_format import ToolDialog, parse

FNS = [{"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "metric": {"type": "boolean"}},
    "required": ["city", "days", "metric"]}},
       {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                           "required": ["zone"]}}]
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def gen():
    from helpers import build_stories

    return build_stories(max_seq_len=1024)


@pytest.mark.parametrize("family, parallel", [(f, False) for f in ("generic", "hermes", "llama3_json", "pythonic",
                                                                   "mistral")] + [("generic", True), ("hermes", True)])
def test_forced_calls_always_parse_and_match_the_schema(gen, family, parallel):
    grammar = ToolGrammar.build(family, FNS, parallel=parallel)
    schemas = {f["name"]: f["parameters"] for f in FNS}
    out = gen.chat_completion([ToolDialog(ASK, [], "generic")] * 3, grammar=grammar, temperature=1.0, top_p=1.0,
                              seed=[1, 2, 3], max_gen_len=200)  # with parallel the last call may be cut short
    for o in out:
        text = o["generation"]["content"]
        content, calls = parse(family, text)
        assert calls, text  # (a tiny model never ends a parallel list: its last call is cut short, and only the
        # tag families parse the calls before it; the list families parse all or nothing)
        if not parallel:  # one call, then the grammar is complete: the reply ends there
            assert content is None and len(calls) == 1 and o.get("finish_reason", "stop") == "stop", text
        for name, args in calls:
            jsonschema.validate(args, schemas[name])


def test_lazy_grammar_waits_for_the_trigger_and_skips_think(gen):
    tok = gen.tokenizer
    grammar = ToolGrammar.build("hermes", FNS, lazy=True, think=True)
    m = grammar.matcher(tok, {tok.eos_id: "eos"})
    row = torch.zeros(gen.model.vocab_size)

    def feed(text):
        for t in tok.encode(text, bos=False, eos=False):
            m.mask(row)
            assert m.consume(t) is False

    feed("<think> I could write <tool_call> here, but I am thinking. </think>")
    assert m.active is None  # the trigger inside the reasoning block did not count
    feed(" Free text {\"name\" [ stays free. ")
    assert m.active is None
    m.mask(row)
    assert torch.isfinite(row).all()  # nothing masked before the trigger
    feed("<tool_call>")
    assert m.active is not None
    m.mask(row)
    allowed = [tok.decode([i]) for i in torch.isfinite(row).nonzero().flatten().tolist()]
    assert allowed and all(a.strip() in ("", "\n") or "\n".startswith(a) for a in allowed), allowed


def test_lazy_grammar_after_a_prompt_that_opened_think(gen):
    """DeepSeek-R1's template opens <think> in the prompt: the reply starts inside the block, so a trigger there
    does not count until </think>; one after it does."""
    tok = gen.tokenizer
    m = ToolGrammar.build("hermes", FNS, lazy=True, think=True, opened=True).matcher(tok, {tok.eos_id: "eos"})
    for t in tok.encode("I could write <tool_call> here. </think> Now", bos=False, eos=False):
        assert m.consume(t) is False
    assert m.active is None
    for t in tok.encode(" <tool_call>", bos=False, eos=False):
        m.consume(t)
    assert m.active is not None
    closed = ToolGrammar.build("hermes", FNS, lazy=True, think=True).matcher(tok, {tok.eos_id: "eos"})
    for t in tok.encode("I could write <tool_call>", bos=False, eos=False):
        closed.consume(t)
    assert closed.active is not None  # without the opened block the same text triggers


def test_lazy_generation_free_until_triggered(gen):
    """A model steered to the trigger by a logits processor for its first tokens writes a valid call after it."""
    tok = gen.tokenizer
    trigger = tok.encode("ok <tool_call>", bos=False, eos=False)

    def steer(generated, logits):
        if len(generated) < len(trigger):
            logits[:] = -1e9
            logits[trigger[len(generated)]] = 0
        return logits

    grammar = ToolGrammar.build("generic", FNS, parallel=False, lazy=True)
    out = gen.chat_completion([ToolDialog(ASK, [], "generic")], grammar=grammar, logits_processors=[steer],
                              temperature=1.0, top_p=1.0, seed=4, max_gen_len=300)
    content, calls = parse("generic", out[0]["generation"]["content"])
    assert content == "ok" and len(calls) == 1
    jsonschema.validate(calls[0][1], {f["name"]: f["parameters"] for f in FNS}[calls[0][0]])
    free = gen.chat_completion([ToolDialog(ASK, [], "generic")], grammar=grammar, temperature=1.0, seed=4,
                               max_gen_len=40)
    assert free[0]["generation"]["content"] == gen.chat_completion([ToolDialog(ASK, [], "generic")], temperature=1.0,
                                                                   seed=4, max_gen_len=40)[0]["generation"]["content"]


@pytest.mark.parametrize("family, text", [
    ("llama3_json", '{"name":"get_time","parameters":{"zone":"UTC"}}; {"name":"get_time","parameters":{"zone":"CET"}}'),
    ("pythonic", '[get_time(zone="UTC"), get_weather(city="Oslo", days=2, metric=True)]'),
    ("mistral", '[TOOL_CALLS] [{"name":"get_time","arguments":{"zone":"UTC"}}, {"name":"get_time","arguments":{}}]'),
])
def test_parallel_list_grammars(gen, family, text):
    """Two calls in one list are what the parallel grammar accepts (the last one of mistral's has bad arguments)."""
    tok = gen.tokenizer
    m = ToolGrammar.build(family, FNS, parallel=True).matcher(tok, {tok.eos_id: "eos"})
    from llama.sample.grammar import vocabulary

    ids = vocabulary(tok).lltok.tokenize_str(text)  # mid-reply text: no sentencepiece dummy-prefix space
    if family == "mistral":
        with pytest.raises(ValueError, match="grammar"):
            [m.consume(t) for t in ids]
        return
    [m.consume(t) for t in ids]
    row = torch.zeros(gen.model.vocab_size)
    m.mask(row)
    assert torch.isfinite(row[tok.eos_id])  # complete: the reply may end here
    single = ToolGrammar.build(family, FNS, parallel=False).matcher(tok, {tok.eos_id: "eos"})
    with pytest.raises(ValueError, match="grammar"):
        [single.consume(t) for t in ids]


def test_bad_schema_is_a_clear_error():
    with pytest.raises(ValueError, match="grammar"):
        ToolGrammar.build("generic", [{"name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "pattern": "(("}}}}])
    assert json  # (json is used by the module under test's schemas)
