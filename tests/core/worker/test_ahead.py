"""Asynchronous decoding (llama/core/worker/ahead.py): a decode step queued before the host reads the previous step's
tokens. On a CPU it gains nothing, so LLAMA_ASYNC_DECODE=auto leaves it off there; these tests switch it on to
prove what it must keep on CUDA: every output (tokens, text, logprobs) is that of synchronous decoding, greedy,
seeded and unseeded, with stop strings, EOS, n samples, the engine's arrivals and a dry KV pool, while queued steps
are really used (and dropped when the plan differs)."""

import pytest
import torch
from conftest import STORIES, need

from llama.core.worker import ahead
from llama.core.frontend.params import SamplingParams
from llama.core.scheduling.plan import Decode, SetBlocks
from llama.core.frontend.request import Request
from llama.core.frontend.textstream import SilentStream

PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog", "Tom had a red ball",
           "One day, a cat"]
GREEDY = dict(temperature=0.0, max_gen_len=40, logprobs=True)
SEEDED = dict(temperature=0.9, top_p=0.95, top_k=40, seed=5, max_gen_len=40, logprobs=True, n=2, stop=["park", "."])
UNSEEDED = dict(temperature=0.8, top_p=0.9, max_gen_len=30)
MIXED = [dict(temperature=0.0, max_gen_len=30), dict(temperature=0.7, seed=3, max_gen_len=30, frequency_penalty=0.5),
         dict(temperature=0.0, max_gen_len=30, logprobs=True, top_logprobs=2)]


def build(slots=4, **kw):
    from llama import Llama

    d = str(need(STORIES))
    return Llama.build(d, d + "/tokenizer.model", max_seq_len=128, max_batch_size=slots, compile=False, **kw)


@pytest.fixture(scope="module")
def gen():
    return build()


def both(gen, call):
    """call() synchronously, then with steps queued ahead; (sync result, ahead result, the runner's counts)."""
    gen.runner.run_ahead = False
    torch.manual_seed(0)
    sync = call()
    gen.runner.run_ahead, gen.runner.ahead_stats = True, {"queued": 0, "used": 0}
    try:
        torch.manual_seed(0)
        return sync, call(), dict(gen.runner.ahead_stats)
    finally:
        gen.runner.run_ahead = False


def strip(preds):
    return [{k: v for k, v in p.items()} for p in preds]


@pytest.mark.parametrize("opts", [GREEDY, SEEDED, UNSEEDED], ids=["greedy", "seeded-n2-stop", "unseeded"])
def test_text_completion_is_the_synchronous_one(gen, opts):
    sync, fast, stats = both(gen, lambda: gen.text_completion(PROMPTS, **opts))
    assert strip(fast) == strip(sync)  # text, tokens and logprobs, bit for bit
    assert stats["used"] > 20, stats


def test_steps_are_dropped_when_the_plan_differs_and_the_output_does_not_change(gen):
    """More prompts than slots: finished requests (EOS, stop strings) make room for waiting ones, so queued steps
    meet plans that admit or shrink; those are dropped and run as planned."""
    opts = dict(temperature=0.0, max_gen_len=50, stop=["."])
    sync, fast, stats = both(gen, lambda: gen.text_completion(PROMPTS * 2, **opts))
    assert strip(fast) == strip(sync)
    assert 0 < stats["used"] < stats["queued"], stats


def test_requests_drawn_on_the_host_run_synchronously_beside_the_others(gen):
    """Penalties and top_logprobs read host lists: a step with such a request is not queued ahead; the batch's
    results are unchanged either way."""
    def call():
        with gen.engine(prefill_chunk=8) as engine:
            return [engine.submit(p, **o).result(timeout=120) for p, o in zip(PROMPTS, MIXED)]

    sync, fast, stats = both(gen, call)
    assert fast == sync
    alone = dict(MIXED[0])
    sync, fast, stats = both(gen, lambda: gen.text_completion(PROMPTS[:1], **alone))
    assert fast == sync and stats["used"] > 0
    penalized = dict(MIXED[1])
    sync, fast, stats = both(gen, lambda: gen.text_completion(PROMPTS[:2], **penalized))
    assert fast == sync and stats == {"queued": 0, "used": 0}


def test_the_engine_with_arrivals_and_streams_is_the_synchronous_one(gen):
    def call():
        with gen.engine(prefill_chunk=6) as engine:
            first = [engine.submit(p, **GREEDY) for p in PROMPTS[:2]]
            deltas = ["".join(first[0])]  # stream the first while the rest arrive
            later = [engine.submit(p, temperature=0.9, seed=9, max_gen_len=35) for p in PROMPTS[2:]]
            return deltas + [h.result(timeout=120)["generation"] for h in first + later]

    sync, fast, stats = both(gen, call)
    assert fast == sync and fast[0] == fast[1]
    assert stats["used"] > 0, stats


def test_a_dry_pool_preempts_alike():
    """Queued steps never write past a request's blocks, so preemption and recompute are unchanged."""
    roomy = build(slots=5, prefix_cache="on")
    tight = build(slots=5, prefix_cache="on", kv_cache_memory=9 * roomy.cache.bytes // roomy.cache.num_blocks)
    sync, fast, stats = both(tight, lambda: tight.text_completion(PROMPTS, **GREEDY))
    assert strip(fast) == strip(sync) and tight.cache.pool.stats["preemptions"] > 0
    assert stats["used"] > 0 and tight.cache.pool.used() == 0


# ---------------------------------------------------------------------------------------------- the rules


def request(prompt_len, generated, max_new, blocks, slot):
    r = Request(prompt=list(range(prompt_len)), params=SamplingParams(), max_new=max_new, stream=SilentStream(),
                stop_tokens={})
    r.generated, r.blocks, r.slot = list(range(generated)), list(range(blocks)), slot
    return r


def test_a_step_is_queued_only_inside_the_blocks_and_tokens_a_request_has():
    op = Decode(tokens=[7, 8], pos=[9, 14], active=[0, 1])
    a, b = request(8, 2, 10, blocks=1, slot=0), request(12, 3, 10, blocks=1, slot=1)  # 16-position blocks
    assert ahead.next_step(op, [a, b], 128, 16) == Decode(tokens=[7, 8], pos=[10, 15], active=[0, 1])
    b.generated = list(range(8))  # its 9th token is drawn now; the 10th would be the last: still queued
    assert ahead.next_step(op, [a, b], 128, 16) is not None
    b.generated = list(range(9))  # the token drawn now is its last
    assert ahead.next_step(op, [a, b], 128, 16) is None
    late = Decode(tokens=[7, 8], pos=[9, 15], active=[0, 1])  # b would write position 16: a block it lacks
    assert ahead.next_step(late, [a, request(12, 3, 10, blocks=1, slot=1)], 128, 16) is None
    assert ahead.next_step(late, [a, request(12, 3, 10, blocks=2, slot=1)], 128, 16) is not None
    assert ahead.next_step(late, [a, request(12, 3, 10, blocks=2, slot=1)], 16, 16) is None  # end of the cache


def test_steps_that_cross_into_a_new_block_are_queued_too(gen):
    """The pool hands a request the block its next step writes one step early (Paging.lookahead), so every decode
    step but the first is queued ahead, across the 16-position blocks."""
    sync, fast, stats = both(gen, lambda: gen.text_completion(PROMPTS[:1], temperature=0.0, max_gen_len=60))
    assert fast == sync  # 60 tokens: the first from the prefill, 59 decode steps, all but the first queued
    assert stats["used"] == stats["queued"] == 58, stats


def test_nothing_is_queued_while_followers_replay_the_engines_ops(gen):
    """Under tensor parallel the engine's followers replay the leader's ops and have no queued step to use, so the
    leader queues none while it serves (outside the engine every rank queues alike: test_tensor_parallel.py)."""
    runner = gen.runner
    runner.execution.lockstep = (None, 0)
    try:
        with runner.leader_samples():
            sync, fast, stats = both(gen, lambda: gen.text_completion(PROMPTS[:2], **GREEDY))
        assert fast == sync and stats == {"queued": 0, "used": 0}
        sync, fast, stats = both(gen, lambda: gen.text_completion(PROMPTS[:2], **GREEDY))
        assert fast == sync and stats["used"] > 20
    finally:
        runner.execution.lockstep = None


def test_a_queued_step_stands_in_only_for_the_same_pass():
    shape = lambda op: (False, max(op.active) + 1, 0)  # noqa: E731 (the eager rule: slots 0..highest active)
    q = ahead.Queued(Decode(tokens=[5, 6, 7], pos=[10, 20, 30], active=[0, 1, 2]), torch.zeros(3, 4), shape(
        Decode(tokens=[5, 6, 7], pos=[10, 20, 30], active=[0, 1, 2])))
    same = Decode(tokens=[5, 6, 7], pos=[10, 20, 30], active=[0, 1, 2])
    assert q.take([same], shape) == 0
    assert q.take([SetBlocks(rows=[1], blocks=[[]]), Decode(tokens=[5, 0, 7], pos=[10, 0, 30], active=[0, 2])],
                  shape) == 1  # a row left (its table cleared): the others' pass is the same
    assert q.take([Decode(tokens=[5, 6, 0], pos=[10, 20, 0], active=[0, 1])], shape) is None  # narrower pass
    assert q.take([Decode(tokens=[5, 9, 7], pos=[10, 20, 30], active=[0, 1, 2])], shape) is None  # another token
    assert q.take([Decode(tokens=[5, 6, 7], pos=[10, 21, 30], active=[0, 1, 2])], shape) is None
    assert q.take([SetBlocks(rows=[1], blocks=[[3, 4]]), same], shape) is None  # growth of a row it did not hold
    q.held = {0: (8,), 1: (3,), 2: (5, 6)}
    assert q.take([SetBlocks(rows=[1], blocks=[[3, 4]]), same], shape) == 1  # extended past what it held
    assert q.take([SetBlocks(rows=[1], blocks=[[4, 3]]), same], shape) is None  # another table under it
    assert q.take([SetBlocks(rows=[2], blocks=[[5]]), same], shape) is None
    assert q.take([SetBlocks(rows=[3], blocks=[[]])], shape) is None  # no decode at all


def test_the_setting(monkeypatch):
    monkeypatch.delenv("LLAMA_ASYNC_DECODE", raising=False)
    assert ahead.enabled(torch.device("cuda"), alone=True) and not ahead.enabled(torch.device("cpu"), alone=True)
    assert not ahead.enabled(torch.device("cuda"), alone=False)
    monkeypatch.setenv("LLAMA_ASYNC_DECODE", "on")
    assert ahead.enabled(torch.device("cpu"), alone=True) and not ahead.enabled(torch.device("cpu"), alone=False)
    monkeypatch.setenv("LLAMA_ASYNC_DECODE", "off")
    assert not ahead.enabled(torch.device("cuda"), alone=True)
    monkeypatch.setenv("LLAMA_ASYNC_DECODE", "sometimes")
    with pytest.raises(ValueError, match="LLAMA_ASYNC_DECODE"):
        ahead.enabled(torch.device("cuda"), alone=True)


def test_a_compiled_step_queued_ahead_is_the_same_graph(monkeypatch):
    """The queued step calls the compiled decode step with inputs made like execute()'s (inference tensors): a guard
    failure would compile a second graph, whose kernels may round differently (seen on an H200: greedy ids parted
    at the 8th token). Dynamo's own path (no stored package), so its guards are checked."""
    monkeypatch.setenv("LLAMA_COMPILE_CACHE", "off")
    from llama import Llama

    d = str(need(STORIES))
    g = Llama.build(d, d + "/tokenizer.model", max_seq_len=64, max_batch_size=1, compile=True)
    torch._dynamo.reset()  # other tests' models compiled the same decode_step: this one's first graph is no recompile
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    sync, fast, stats = both(g, lambda: g.text_completion(PROMPTS[:1], temperature=0.0, max_gen_len=24,
                                                          logprobs=True))
    assert strip(fast) == strip(sync) and stats["used"] > 10
