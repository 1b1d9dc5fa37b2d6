"""The one decode core: every public path gives the same text (greedy and seeded, alone, batched, streamed, in a
session, through the engine), n samples of a prompt are prefilled once on every path, a broken logits processor
or unusable logits fail only their own request, and the model's forward pass is called from one module."""

import math
import re

import pytest
import torch
from conftest import REPO, STORIES

from llama import BatchError
from llama.core.scheduling.plan import Prefill

PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog"]
DIALOG = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Tell me about a cat"}]
GREEDY = dict(temperature=0.0, max_gen_len=24)
SEEDED = dict(temperature=0.9, top_p=0.95, top_k=50, seed=11, max_gen_len=24)


def wide(slots):
    from llama import Llama

    d = str(STORIES)
    return Llama.build(d, d + "/tokenizer.model", max_seq_len=64, max_batch_size=slots)


def texts(preds):
    return [p["generation"] for p in preds]


def prompt_tokens_computed(stories, monkeypatch):
    """Count prompt positions the model computes (prefill ops, padding excluded)."""
    counted = []
    execute = stories.runner.execute

    def spy(ops):
        for op in ops:
            if isinstance(op, Prefill):
                counted.append(sum(last + 1 for last in op.last))
        return execute(ops)

    monkeypatch.setattr(stories.runner, "execute", spy)
    return counted


@pytest.mark.parametrize("opts", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_every_path_gives_the_same_text(stories, opts):
    alone = [stories.text_completion([p], **opts)[0]["generation"] for p in PROMPTS]
    assert texts(stories.text_completion(PROMPTS, **opts)) == alone
    assert texts(stories.text_completion(PROMPTS * 3, **opts)) == alone * 3  # more prompts than slots
    assert ["".join(stories.stream_completion(p, **opts)) for p in PROMPTS] == alone
    with stories.engine(prefill_chunk=5) as engine:
        handles = [engine.submit(p, **opts) for p in PROMPTS]
        assert [h.result(timeout=60)["generation"] for h in handles] == alone
    if opts is GREEDY:
        ids = [stories.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
        out, _ = stories.generate(ids, max_gen_len=24, temperature=0.0)
        assert [continuation(stories, i, o) for i, o in zip(ids, out)] == alone

    reply = stories.chat_completion([DIALOG], **opts)[0]["generation"]["content"]
    assert [c["generation"]["content"] for c in stories.chat_completion([DIALOG, DIALOG[1:], DIALOG], **opts)][::2] == [reply] * 2
    assert "".join(stories.stream_chat(DIALOG, **opts)) == reply
    assert stories.chat_session(system="Be brief").send(DIALOG[1]["content"], **opts) == reply
    with stories.engine() as engine:
        assert engine.submit(DIALOG, **opts).result(timeout=60)["generation"]["content"] == reply


def continuation(stories, context, generated):
    tok = stories.tokenizer
    return tok.decode(context + generated)[len(tok.decode(context)):]


def test_n_samples_prefill_once_on_every_path(stories, monkeypatch):
    counted = prompt_tokens_computed(stories, monkeypatch)
    lengths = [len(stories.tokenizer.encode(p, bos=True, eos=False)) for p in PROMPTS[:2]]
    sampled = dict(temperature=1.0, max_gen_len=6, seed=3)

    res = stories.text_completion(PROMPTS[:1], n=4, **sampled)  # all four fit: one static batch
    assert len(set(texts(res))) > 1 and sum(counted) == lengths[0]
    counted.clear()
    # 2 prompts x 3 samples in 4 slots: continuous batching; a prompt's samples are admitted together.
    expected = [r for r in texts(stories.text_completion(PROMPTS[:2], temperature=0.0, max_gen_len=6)) for _ in range(3)]
    counted.clear()
    res = stories.text_completion(PROMPTS[:2], n=3, temperature=0.0, max_gen_len=6)
    assert texts(res) == expected
    assert sum(counted) == sum(lengths)
    counted.clear()
    # More samples than slots: the first four start together; the rest copy whichever sample is still running,
    # or one of them computes the prompt again if none is. Seeded draws make the order invisible.
    many = stories.text_completion(PROMPTS[1:2], n=6, **sampled)
    assert sum(counted) <= 2 * lengths[1]
    assert texts(wide(8).text_completion(PROMPTS[1:2], n=6, **sampled)) == texts(many)
    counted.clear()
    chat = stories.chat_completion([DIALOG], n=3, **sampled)
    assert len(chat) == 3 and sum(counted) == len(stories.formatter.encode_dialog_prompt(DIALOG))
    counted.clear()
    with stories.engine(prefill_chunk=4) as engine:  # a prompt prefilled over several steps, then copied
        handles = engine.submit_samples(PROMPTS[1], 3, **sampled)
        got = [h.result(timeout=60) for h in handles]
    assert sum(counted) == lengths[1]
    assert got == stories.text_completion(PROMPTS[1:2], n=3, **sampled)
    assert engine.stats["prefill_tokens"] == lengths[1]


def raising(ids, logits):
    raise RuntimeError("boom")


def returns_none(ids, logits):
    return None


def wrong_shape(ids, logits):
    return logits[:10]


def all_minus_inf(ids, logits):
    return torch.full_like(logits, -math.inf)


def nan_logits(ids, logits):
    return torch.full_like(logits, math.nan)


BROKEN = {raising: "raised RuntimeError", returns_none: "returned None", wrong_shape: r"returned shape \(10,\)",
          all_minus_inf: "all -inf or contain NaN", nan_logits: "all -inf or contain NaN"}


@pytest.mark.parametrize("proc", list(BROKEN), ids=[p.__name__ for p in BROKEN])
def test_a_broken_processor_fails_only_its_request_on_every_path(stories, proc):
    message = BROKEN[proc]
    clean = texts(stories.text_completion(PROMPTS, **SEEDED))
    procs = [[], [proc], []]
    for prompts, expected in ((PROMPTS, clean), (PROMPTS * 2, clean * 2)):  # static batch, continuous batching
        with pytest.raises(BatchError, match=message) as info:
            stories.text_completion(prompts, logits_processors=procs * (len(prompts) // 3), **SEEDED)
        failed = [i for i in range(len(prompts)) if i % 3 == 1]
        assert sorted(info.value.errors) == failed and proc.__name__ in str(info.value)
        assert [p and p["generation"] for p in info.value.predictions] == [
            None if i in failed else t for i, t in enumerate(expected)]
    with pytest.raises(ValueError, match=message):
        "".join(stories.stream_completion(PROMPTS[0], logits_processors=[proc], **SEEDED))
    with pytest.raises(BatchError, match=message) as info:
        stories.chat_completion([DIALOG, DIALOG], logits_processors=[[proc], []], **SEEDED)
    assert info.value.predictions[1] == stories.chat_completion([DIALOG], **SEEDED)[0]
    session = stories.chat_session()
    with pytest.raises(ValueError, match=message):
        session.send("Hello", logits_processors=[proc], **SEEDED)
    assert session.dialog == [] and session.send("Hello", **GREEDY)
    with stories.engine() as engine:
        handles = [engine.submit(p, logits_processors=q, **SEEDED) for p, q in zip(PROMPTS, procs)]
        with pytest.raises(ValueError, match=message):
            handles[1].result(timeout=60)
        assert [handles[i].result(timeout=60)["generation"] for i in (0, 2)] == [clean[0], clean[2]]
    assert handles[1].finish_reason == "error"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_temperature_is_refused(stories, value):
    with pytest.raises(ValueError, match="temperature must be >= 0 and finite"):
        stories.text_completion(PROMPTS, temperature=value)
    with stories.engine() as engine:
        with pytest.raises(ValueError, match="temperature"):
            engine.submit(PROMPTS[0], temperature=value).result(timeout=60)


def test_one_module_calls_the_model_to_decode():
    """Only the runner calls the model's forward pass (the rest of the package plans, builds and formats)."""
    package = REPO / "llama"
    callers = set()
    for path in package.rglob("*.py"):
        if re.search(r"\bmodel\(|\.model\.forward\(|\bmodel\.decode_step\(", path.read_text()):
            callers.add(path.name)
    assert callers == {"runner.py"}, callers


def test_a_stream_closed_early_gives_its_blocks_back(stories):
    """Closing (or dropping) a stream mid-generation cancels its request and releases its KV pool blocks: before,
    they stayed referenced for the generator's life, and every closed stream shrank the pool for good."""
    pool = stories.cache.pool
    stories.text_completion(["a"], temperature=0, max_gen_len=1)  # earlier tests' dropped prefixes go back now
    before = pool.used()
    stream = stories.stream_completion("Once upon a time", temperature=0, max_gen_len=40)
    next(stream)
    assert pool.used() > before
    stream.close()
    assert pool.used() == before
    assert stories.text_completion(["Lily"], temperature=0, max_gen_len=4)  # the cache is free again
