"""Lazy block growth and preemption on the paged KV pool (llama/core/scheduling/paging.py): blocks grow with use, a dry pool
preempts the most recently admitted request, which is recomputed and goes on where it was. The scheduler's ops on a
pool with no model, then stories260K (fp32) in a pool far smaller than its requests' need against a roomy pool:
the same tokens greedy and seeded, with n samples, stop strings, logprobs and a grammar, through text_completion
(DecodeCore.run), the engine (streamed deltas), and the server's /metrics."""

import pytest
from conftest import STORIES, need
from helpers import ready_client

from llama.core.scheduling.block_pool import BlockPool
from llama.core.frontend.params import SamplingParams
from llama.core.scheduling.plan import Decode, Prefill, SetBlocks
from llama.core.frontend.request import Request
from llama.core.scheduling.scheduler import Scheduler
from llama.core.frontend.textstream import SilentStream

PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog", "Tom had a red ball",
           "One day, a cat", "The sun was hot"]



def request(length: int, max_new: int, first: int) -> Request:
    return Request(prompt=list(range(first, first + length)), params=SamplingParams(), max_new=max_new,
                   stream=SilentStream(), stop_tokens={})


def step(sched: Scheduler) -> list:
    """Plan a step and do what the runner and the core do with it, sampling 1000 + the token's index (so the
    ops show which tokens a recompute feeds); returns the ops."""
    plan = sched.plan()
    ready = [r for r, s, c in plan.prefill if s + c == len(r.prompt) and not r.generated]
    for r in ready + plan.decoding:
        r.advance(1000 + len(r.generated))
    for r in sched.running():
        if r.finished:
            sched.retire(r)
    return plan.ops


def test_blocks_grow_with_use_and_a_dry_pool_preempts_the_newest():
    pool = BlockPool(num_blocks=6, block_size=4)
    sched = Scheduler(max_batch_size=3, max_seq_len=16, prefill_chunk=64, pool=pool)
    a, b = request(5, max_new=10, first=10), request(6, max_new=10, first=20)
    sched.add([a, b])
    ops = step(sched)  # admission: the prompt and the first decoded token, not prompt + max_new
    assert ops[:2] == [SetBlocks(rows=[0], blocks=[a.blocks]), SetBlocks(rows=[1], blocks=[b.blocks])]
    assert len(a.blocks) == 2 and len(b.blocks) == 2 and pool.available() == 2
    while not b.blocks[2:]:  # b writes past its second block at position 8: it gets a third
        ops = step(sched)
        assert all(len(r.blocks) <= pool.blocks_for(len(r.prompt) + len(r.generated)) + 1 for r in sched.running())
    assert SetBlocks(rows=[1], blocks=[b.blocks]) in ops and len(b.blocks) == 3
    while sched.stats["preemptions"] == 0:
        ops = step(sched)
    # a needed its third block with none left: b, the newest, was preempted and queued first, a went on
    assert sched.slots == [a, None, None] and list(sched.waiting) == [b] and b.blocks == [] and b.slot == -1
    assert ops[0] == SetBlocks(rows=[1], blocks=[[]]) and pool.stats["preemptions"] == 1
    assert b.resumed == len(b.generated) - 1 and b.feed is None
    generated = list(b.generated)
    while b.slot < 0:
        ops = step(sched)
    # re-admitted: its prompt and every generated token but the last are prefilled, nothing is sampled ...
    assert [op.tokens[0][: len(b.context)] for op in ops if isinstance(op, Prefill)] == [b.prompt + generated[:-1]]
    assert b.generated == generated
    ops = step(sched)  # ... and the last one is fed to the next decode step, at its position
    decode = [op for op in ops if isinstance(op, Decode)][0]
    assert decode.tokens[b.slot] == generated[-1] and decode.pos[b.slot] == len(b.prompt) + len(generated) - 1
    while sched.has_work():
        step(sched)
    assert a.generated == b.generated == [1000 + i for i in range(10)] and pool.used() == 0


def test_a_request_preempted_before_its_first_token_starts_over():
    pool = BlockPool(num_blocks=5, block_size=4)
    sched = Scheduler(max_batch_size=2, max_seq_len=16, prefill_chunk=4, pool=pool)
    a, b = request(7, max_new=9, first=10), request(9, max_new=4, first=30)
    sched.add([a, b])
    while not sched.stats["preemptions"]:
        b.prompt_logprobs = [-1.0] * b.prefilled  # as an echoing request's chunks score its prompt
        step(sched)
    assert list(sched.waiting) == [b] and b.generated == [] and b.resumed == 0 and b.prefilled == 0
    assert b.prompt_logprobs == []  # its prompt is scored again from the start
    while sched.has_work():
        step(sched)
    assert a.generated == [1000 + i for i in range(9)] and b.generated == [1000 + i for i in range(4)]


# ---------------------------------------------------------------------------------------------- stories260K


def build(mode="on", slots=6, seq=128, blocks=None):
    """stories260K (fp32); blocks: a pool of that many 16-position blocks (one max_seq_len sequence is 8)."""
    from llama import Llama

    d = str(need(STORIES))
    gen = Llama.build(d, d + "/tokenizer.model", max_seq_len=seq, max_batch_size=slots, prefix_cache=mode)
    if blocks is None:
        return gen
    per = gen.cache.bytes // gen.cache.num_blocks
    return Llama.build(d, d + "/tokenizer.model", max_seq_len=seq, max_batch_size=slots, prefix_cache=mode,
                       kv_cache_memory=blocks * per)


@pytest.fixture(scope="module")
def roomy():
    return build()


GREEDY = dict(temperature=0.0, max_gen_len=60, logprobs=True)
SEEDED = dict(temperature=0.9, top_p=0.95, seed=7, max_gen_len=60, logprobs=True, n=2, stop=["park", "ball"])
ECHO = dict(temperature=0.0, max_gen_len=60, logprobs=True, echo=True, top_logprobs=2)


def same(got, want):
    """The same text and tokens; logprobs up to the last bits (a recomputed position's keys are prefill's, not
    decode's, and the batches differ)."""
    assert [g["generation"] for g in got] == [w["generation"] for w in want]
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    for g, w in zip(got, want):
        assert len(g["logprobs"]) == len(w["logprobs"])
        assert max((abs(x - y) for x, y in zip(g["logprobs"], w["logprobs"])), default=0) < 1e-4
        if "top_logprobs" in w:
            assert [[t["id"] for t in top] for top in g["top_logprobs"]] == [[t["id"] for t in top] for top in
                                                                             w["top_logprobs"]]


@pytest.mark.parametrize("mode", ["on", "exact", "off"])
@pytest.mark.parametrize("opts", [GREEDY, SEEDED, ECHO], ids=["greedy", "seeded-n2-stop", "echo"])
def test_text_completion_in_a_dry_pool_equals_a_roomy_one(roomy, mode, opts):
    tight = build(mode, blocks=9)  # 6 slots, 6-12 prompts of up to 60 new tokens: they need 30-60 blocks
    want = roomy.text_completion(PROMPTS, **opts)
    got = tight.text_completion(PROMPTS, **opts)
    same(got, want)
    assert tight.cache.pool.stats["preemptions"] > 0 and tight.cache.pool.used() == 0


def test_engine_streams_and_samples_in_a_dry_pool_as_in_a_roomy_one(roomy):
    """Concurrent engine requests (greedy, seeded n=3, a stop string, a grammar, echo): the same results, and each
    request's streamed deltas add up to its text (a preempted request repeats none)."""
    pytest.importorskip("llguidance", reason="grammars need llguidance: pip install -e '.[serve]'")
    from helpers import check_stream

    grammar = {"regex": "[A-Za-z ,.]{20,200}"}
    jobs = [(PROMPTS[0], 1, dict(GREEDY)), (PROMPTS[1], 3, dict(SEEDED, n=None)), (PROMPTS[2], 1, dict(GREEDY)),
            (PROMPTS[3], 2, dict(SEEDED, n=None, seed=3, grammar=grammar)), (PROMPTS[4], 1, dict(GREEDY)),
            (" ".join(PROMPTS), 1, dict(ECHO))]

    def run(gen):
        with gen.engine(prefill_chunk=16) as engine:
            reqs = [r for p, n, o in jobs for r in engine.submit_samples(p, n, **{k: v for k, v in o.items()
                                                                                    if k != "n"})]
            deltas = [list(r) for r in reqs]
            out = [r.result() for r in reqs]
            return out, deltas, [r.stream.text for r in reqs], dict(engine.stats)

    want, _, _, _ = run(roomy)
    tight = build("on", blocks=9)
    got, deltas, texts, stats = run(tight)
    same(got, want)
    for d, text, g in zip(deltas, texts, got):
        check_stream(d, text)
        assert g["generation"].endswith(text) and text  # (with echo the generation starts with the prompt)
    assert stats["preemptions"] > 0 and tight.cache.pool.stats["preemptions"] == stats["preemptions"]
    assert tight.cache.pool.used() == 0


def test_server_counts_preemptions_and_answers_every_request(roomy):
    pytest.importorskip("starlette", reason="the server needs the serve extra: pip install -e '.[serve]'")
    pytest.importorskip("httpx")
    from concurrent.futures import ThreadPoolExecutor

    from llama.serve.app import create_app

    tight = build("on", blocks=9)
    body = dict(model="s", max_tokens=60, temperature=0)
    want = [w["generation"] for w in roomy.text_completion(PROMPTS, temperature=0.0, max_gen_len=60)]
    with ready_client(create_app(lambda: tight, "s")) as c:
        with ThreadPoolExecutor(6) as ex:
            rs = list(ex.map(lambda p: c.post("/v1/completions", json={**body, "prompt": p}), PROMPTS))
        assert [r.status_code for r in rs] == [200] * 6, [r.text for r in rs]
        assert [r.json()["choices"][0]["text"] for r in rs] == want
        metrics = c.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("llama_")}
    assert values["llama_kv_preemptions"] > 0 and values["llama_kv_blocks_used"] == 0
