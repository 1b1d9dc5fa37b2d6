"""Draft-model drafting (llama/core/speculation/draft_model.py): a model drafting for itself accepts every drafted token, and
with another draft (random weights sharing the vocabulary) every greedy and seeded output, on the batch and the
engine paths, is token for token the output without speculation; a draft whose vocabulary differs is refused."""

import pytest
from conftest import CPU_SPECULATION, LLAMA2_TOKENIZER, STORIES, need
from helpers import draft_tally

from llama import Llama
from llama.core.speculation import draft_model, speculative
from llama.core.speculation.draft_model import DraftModel
from llama.hub.demo import write_random_checkpoint

pytestmark = CPU_SPECULATION

PROMPTS = ["Once upon a time", "Lily and Ben went to the park. Lily and Ben", "The cat sat on the mat. The cat"]
SAMPLED = (dict(temperature=0), dict(temperature=1.0, top_p=0.95, seed=7, n=2),
           dict(temperature=0.8, top_k=20, seed=3, logprobs=True))


@pytest.fixture(scope="module")
def mp():
    m = pytest.MonkeyPatch()
    m.setattr(speculative, "MEASURE", False)  # drafts decided by the tokens alone, not by the machine's load
    yield m
    m.undo()


@pytest.fixture(scope="module")
def tally(mp):
    return draft_tally(mp.setattr)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """Random weights, stories260K's vocabulary (512), a smaller shape: a draft that is often wrong."""
    params = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 16, "norm_eps": 1e-5,
              "vocab_size": 512}
    return write_random_checkpoint(tmp_path_factory.mktemp("draft"), params, seed=3)


def build(draft=None, max_batch_size=4):
    d = str(need(STORIES))
    return Llama.build(d, d + "/tokenizer.model", max_seq_len=256, max_batch_size=max_batch_size, compile=False,
                       prefix_cache="off", draft_model=None if draft is None else str(draft))


@pytest.fixture(scope="module")
def off(mp):
    return build()


def test_a_model_drafting_for_itself_accepts_every_token(off, tally):
    """Greedy and seeded (the draft samples each position with the target's draw), every drafted token is accepted,
    and the output is the output without a draft."""
    on = build(STORIES)
    for opts in (dict(temperature=0), dict(temperature=0.8, seed=5, logprobs=True),
                 dict(temperature=1.0, top_p=0.9, top_k=40, seed=9, n=2, presence_penalty=0.5)):
        tally.clear()
        for p in PROMPTS:  # one at a time: the draft's prompt pass is then the target's, bit for bit
            assert on.text_completion([p], max_gen_len=60, **opts) == off.text_completion(
                [p], max_gen_len=60, **opts), opts
        assert tally["drafted"] > 60 and tally["accepted"] == tally["drafted"], (opts, dict(tally))
    engine = on.engine()  # the engine's path, one request at a time
    try:
        for p in PROMPTS:
            got = engine.submit(p, temperature=0, max_gen_len=60).result(timeout=120)["generation"]
            assert got == off.text_completion([p], temperature=0, max_gen_len=60)[0]["generation"]
        stats = dict(engine.stats)
    finally:
        engine.close()
    assert stats["drafted_tokens"] > 60 and stats["accepted_tokens"] == stats["drafted_tokens"], stats


def test_drafting_with_the_targets_draw_accepts_more_than_greedy_drafts(off, tally, monkeypatch):
    """At temperature 0.8 a self-draft drafting greedily has its drafts rejected wherever the seeded draw is not the
    argmax; drafting with the draw accepts them all. Outputs are the same either way (the batch too)."""
    on = build(STORIES)
    opts = dict(temperature=0.8, seed=5, max_gen_len=60)
    expected = off.text_completion(PROMPTS, **opts)
    rates = {}
    for how in ("draw", "greedy"):
        if how == "greedy":
            monkeypatch.setattr(draft_model, "picker", lambda *a: lambda logits, drafted: int(logits.argmax()))
        tally.clear()
        assert on.text_completion(PROMPTS, **opts) == expected, how
        rates[how] = tally["accepted"] / tally["drafted"]
    assert rates["draw"] > 0.95 and rates["greedy"] < 0.8, rates


def test_outputs_with_another_draft_are_the_outputs_without(off, small_draft, tally, monkeypatch):
    on = build(small_draft)
    monkeypatch.setattr(speculative.Speculator, "acceptance", lambda *a: 0.9)  # keep drafting, though it is wrong
    tally.clear()
    for opts in SAMPLED:
        assert on.text_completion(PROMPTS, max_gen_len=50, **opts) == off.text_completion(
            PROMPTS, max_gen_len=50, **opts), opts
    assert tally["drafted"] > 20 and tally["accepted"] < tally["drafted"], tally  # it was wrong, and it did not matter
    jobs = [dict(prompt=p, temperature=t, seed=s, max_gen_len=40) for p, t, s in zip(PROMPTS * 2, (0, 1.0, 0.7) * 2,
                                                                                     (None, 1, 2, None, 3, 4))]
    results = []
    for g in (off, on):
        engine = g.engine(prefill_chunk=8)  # prompts prefilled in chunks beside drafting requests
        try:
            results.append([r.result(timeout=120) for r in [engine.submit(**job) for job in jobs]])
            stats = engine.stats
        finally:
            engine.close()
    assert results[0] == results[1]
    assert stats["drafted_tokens"] > 20 and stats["verify_steps"] > 0, stats  # the engine drafted and verified too


def test_the_cache_end(small_draft, tally):
    """Generation running into max_seq_len, with drafts cut to the positions left, in both caches: the self-draft
    is accepted right up to the end."""
    d = str(need(STORIES))
    off, on = (Llama.build(d, d + "/tokenizer.model", max_seq_len=40, max_batch_size=3, compile=False,
                           prefix_cache="off", draft_model=draft) for draft in (None, str(STORIES)))
    for opts in (dict(temperature=0), dict(temperature=1.0, seed=11)):
        tally.clear()
        got = on.text_completion(PROMPTS, logprobs=True, **opts)
        assert got == off.text_completion(PROMPTS, logprobs=True, **opts)
        lens = [len(on.tokenizer.encode(p, bos=True, eos=False)) + len(g["tokens"]) for p, g in zip(PROMPTS, got)]
        assert 40 in lens and tally["accepted"] > 0, (lens, opts, dict(tally))


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    params = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 16, "norm_eps": 1e-5,
              "vocab_size": 32000}
    d = write_random_checkpoint(tmp_path, params, tokenizer_path=need(LLAMA2_TOKENIZER))
    with pytest.raises(ValueError, match=r"draft_model=.*vocab_size is 32000 but the tokenizer .* has 512 tokens"):
        build(d, max_batch_size=1)  # loaded with the model's tokenizer, which its vocabulary does not fit
    drafting = Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=32, max_batch_size=1, compile=False)
    with pytest.raises(ValueError, match=r"draft_model='d' has a vocabulary of 32000 tokens and the model 512"):
        DraftModel(drafting.runner, 512, "draft_model='d'")  # a GGUF draft brings its own tokenizer: checked here
    with pytest.raises(ValueError, match="two sources of drafts"):
        Llama.build(str(d), None, max_seq_len=32, max_batch_size=1, speculative="ngram", draft_model=str(d))
    with pytest.raises(ValueError, match="draft_model=PATH"):
        Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=32, max_batch_size=1, speculative="draft")
    with pytest.raises(ValueError, match="drafts in one process"):
        Llama.build(str(d), None, max_seq_len=32, max_batch_size=1, model_parallel_size=2, draft_model=str(d))


def test_the_flags_reach_the_build(tmp_path, capsys):
    """The chat CLI's --draft-model reaches Llama.build (its refusal of a mismatched draft is printed); the server
    takes the flag too."""
    from llama.cli import chat
    from llama.serve.__main__ import parse_args

    params = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 16, "norm_eps": 1e-5,
              "vocab_size": 32000}
    d = write_random_checkpoint(tmp_path, params)
    s = str(need(STORIES))
    assert chat.main(["--ckpt_dir", s, "--tokenizer_path", s + "/tokenizer.model", "--max_seq_len", "64",
                      "--draft-model", str(d)]) == 2
    assert f"draft_model={str(d)!r}" in capsys.readouterr().err
    assert parse_args(["--draft-model", str(d)]).draft_model == str(d)


class _Drafter:
    """What the Speculator asks of a draft model, with its answers set by the test."""

    def __init__(self, once=False, held=()):
        self.once, self.held, self.asked = once, set(held), []

    def once_off(self):
        once, self.once = self.once, False
        return once

    def holds(self, request, row):
        return request.id in self.held

    def draft(self, request, row, prompt, tokens, k):
        self.asked.append(request.id)
        return [7] * k


def test_a_draft_models_prompt_pass_is_neither_timed_nor_paid_for_exploring(monkeypatch):
    """A step in which the draft model ran a prompt pass (or a long catch-up) is left out of the step times; with
    nothing worth drafting for EXPLORE steps, the 1-token exploration drafts only for a request whose prompt the
    draft model already holds."""
    from llama.core.frontend.params import SamplingParams
    from llama.core.scheduling.plan import Decode, Plan

    class Req:
        def __init__(self, i):
            self.params, self.feed, self.max_new, self.generated = SamplingParams(), 5, 100, [5]
            self.prompt, self.next_pos, self.blocks, self.order, self.slot, self.id = [1, 2, 3], 3, [], i, i, i
            self.predicted = None

    def step(spec, reqs, now):
        plan = Plan(ops=[Decode(tokens=[5] * len(reqs), pos=[3] * len(reqs), active=list(range(len(reqs))))],
                    decoding=list(reqs))
        monkeypatch.setattr(speculative.time, "perf_counter", lambda: now)
        spec.plan(plan)
        return plan

    for once, timed in ((False, [0.5, 0.5]), (True, [0.5])):
        drafter = _Drafter()
        spec = speculative.Speculator({}, 0, 256, 0, "draft", speculative.Memory(), drafter)
        spec.times.measure = True
        spec.times.add(1, 1.0)  # a 1-row step is known; a verify of 2 to 8 rows would cost 100 steps
        spec.times.add(2, 100.0)
        reqs = [Req(0)]
        step(spec, reqs, 0.0)  # plain: timed from here to the next plan
        drafter.once = once  # this step's drafting ran a prompt pass (as if)
        step(spec, reqs, 0.5)
        step(spec, reqs, 1.0)
        assert list(spec.times._seen[1])[1:] == timed, once
    spec.memory.idle = speculative.EXPLORE
    assert not step(spec, [Req(1)], 2.0).verifying and drafter.asked == []  # not held: no prompt pass
    drafter.held.add(2)
    plan = step(spec, [Req(2)], 3.0)
    assert plan.verifying and plan.verifying[0][1] == [7] and drafter.asked == [2]
