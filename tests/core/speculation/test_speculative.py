"""Speculative decoding (llama/core/speculation/speculative.py): the verify pass's logits are the one-token step's bit for bit,
and with speculation on every greedy and seeded output is token for token the output without it."""

import collections
import math

import pytest
import torch
from conftest import CPU_SPECULATION, LLAMA2_TOKENIZER, STORIES, need
from helpers import draft_tally

from llama import Llama
from llama.core.speculation import speculative
from llama.core.scheduling.plan import Decode, Prefill, SetBlocks, Verify
from llama.hub.demo import write_random_checkpoint
from llama.sample.lookup import NgramIndex

pytestmark = CPU_SPECULATION

DTYPES = ["float32", "bfloat16"]
PROMPTS = ["Once upon a time", "Lily and Ben went to the park. Lily and Ben", "The cat sat on the mat. The cat"]


@pytest.fixture(scope="module")
def tally(monkeypatch_module):
    """Drafted and accepted tokens over every Speculator, so tests can show their drafts were accepted."""
    return draft_tally(monkeypatch_module.setattr)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module", autouse=True)
def untimed(monkeypatch_module):
    """Drafts decided by the tokens alone (the prior costs), not by how busy the machine is: the acceptance counts
    the tests assert do not depend on the load."""
    monkeypatch_module.setattr(speculative, "MEASURE", False)


@pytest.fixture(scope="module")
def rand_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec_rand")
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "norm_eps": 1e-5,
              "vocab_size": 32000}
    return write_random_checkpoint(d, params, tokenizer_path=need(LLAMA2_TOKENIZER), std=0.5)


_built = {}


def stories(dtype="float32", spec="ngram", max_seq_len=256, max_batch_size=4):
    """stories260K (a trained model: its stories repeat, so prompt lookup finds drafts that it accepts)."""
    key = (dtype, spec, max_seq_len, max_batch_size)
    if key not in _built:
        need(STORIES / "consolidated.00.pth")
        _built[key] = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=max_seq_len,
                                  max_batch_size=max_batch_size, dtype=dtype, speculative=spec, compile=False,
                                  prefix_cache="off")
    return _built[key]


def both(dtype="float32", **kw):
    return stories(dtype, None, **kw), stories(dtype, "ngram", **kw)


# ---------------------------------------------------------------------------------------------- the verify pass
@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_rows_are_the_one_token_steps_bit_for_bit(rand_dir, dtype):
    """Two requests' drafts and a third request's single token in one Verify pass give exactly the logits of
    one-token Decode steps at each position."""
    g = Llama.build(str(rand_dir), str(rand_dir / "tokenizer.model"), max_seq_len=64, max_batch_size=4, dtype=dtype,
                    compile=False, prefix_cache="off")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in (11, 20, 5)]
    feeds = [torch.randint(3, 32000, (k + 1,), generator=gen).tolist() for k in (3, 2, 0)]  # MAX_ROWS rows
    with g.cache.hold():
        blocks = [g.cache.pool.allocate(4) for _ in prompts]

        def prefill():
            ops = [SetBlocks(rows=[0, 1, 2], blocks=blocks)]
            for row, p in enumerate(prompts):
                ops.append(Prefill(tokens=[p], start=0, rows=[row], last=[len(p) - 1], kv_len=len(p)))
            g.runner.execute(ops)

        prefill()
        want = []
        for row, (p, f) in enumerate(zip(prompts, feeds)):
            for i, t in enumerate(f):
                tokens, pos = [0, 0, 0], [len(q) for q in prompts]  # dummies past the others' ends
                tokens[row], pos[row] = t, len(p) + i
                want.append(g.runner.execute([Decode(tokens=tokens, pos=pos, active=[row])])[0][row])
        prefill()  # the same prompts again: the decode steps' positions are rewritten by the verify pass
        op = Verify(tokens=[t for f in feeds for t in f],
                    pos=[len(p) + i for p, f in zip(prompts, feeds) for i in range(len(f))],
                    rows=[row for row, f in enumerate(feeds) for _ in f])
        got = g.runner.execute([op])[0]
        g.cache.pool.release([b for bl in blocks for b in bl])
    assert got.shape[0] == len(want) == speculative.MAX_ROWS
    for i, w in enumerate(want):
        assert torch.equal(got[i], w), f"row {i}: max difference {(got[i] - w).abs().max()}"


def test_ngram_index_drafts_from_the_latest_match():
    idx = NgramIndex()
    assert idx.draft([1, 2, 3], 4) == []
    assert idx.draft([1, 2, 3, 9, 1, 2], 2) == [3, 9]
    assert idx.draft([5, 1, 2, 7, 1, 2, 8, 1, 2], 3) == [8, 1, 2]  # the latest of two matches
    assert idx.draft([4, 7, 4, 7, 4], 5) == [7, 4, 7, 4, 7]  # a loop, copied on past the end
    assert idx.draft([4, 7, 4, 7, 4], 0) == []


def test_bad_mode_is_refused(rand_dir):
    with pytest.raises(ValueError, match="speculative must be"):
        Llama.build(str(rand_dir), str(rand_dir / "tokenizer.model"), max_seq_len=32, max_batch_size=1,
                    speculative="medusa")
    with pytest.raises(ValueError, match="speculative must be True or False"):
        stories().text_completion(["Once"], speculative="yes")


# ---------------------------------------------------------------------------------------------- identical outputs
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_and_seeded_outputs_are_identical(dtype, tally):
    """Each option set drafts and accepts on its own: one that stopped drafting would fail here, not hide in a sum."""
    off, on = both(dtype)
    for opts in (dict(temperature=0), dict(temperature=1.0, top_p=0.95, seed=7, n=2),
                 dict(temperature=0.8, top_k=20, seed=3, logprobs=True, top_logprobs=3),
                 dict(temperature=0, repetition_penalty=1.1, frequency_penalty=0.2, logprobs=True)):
        tally.clear()
        assert on.text_completion(PROMPTS, max_gen_len=120, **opts) == off.text_completion(PROMPTS, max_gen_len=120,
                                                                                         **opts), opts
        assert tally["accepted"] > 0, (opts, tally)


def test_stops_and_max_tokens_inside_accepted_runs(tally):
    """Every max_gen_len and a stop string at every word of the greedy text: wherever they fall, inside or at the
    end of an accepted run, speculation ends where plain decoding does."""
    off, on = both()
    prompt = [PROMPTS[1]]
    full = off.text_completion(prompt, temperature=0, max_gen_len=80)[0]["generation"]
    tally.clear()
    for n in range(1, 60, 3):
        assert on.text_completion(prompt, temperature=0, max_gen_len=n) == off.text_completion(
            prompt, temperature=0, max_gen_len=n), n
    words = sorted(set(full.split()[2:40]))
    for w in words:
        a = on.text_completion(prompt, temperature=0.7, seed=2, max_gen_len=80, stop=[w], logprobs=True)
        assert a == off.text_completion(prompt, temperature=0.7, seed=2, max_gen_len=80, stop=[w], logprobs=True), w
    assert tally["accepted"] > 50, tally


def test_the_cache_end(tally):
    """Generation running into max_seq_len: drafts are cut to the positions left, and still accepted."""
    off, on = both(max_seq_len=48)
    for opts in (dict(temperature=0), dict(temperature=1.0, seed=11)):
        tally.clear()
        got = on.text_completion(PROMPTS, logprobs=True, **opts)
        assert got == off.text_completion(PROMPTS, logprobs=True, **opts)
        prompt_lens = [len(on.tokenizer.encode(p, bos=True, eos=False)) for p in PROMPTS]
        assert any(n + len(g["tokens"]) == 48 for n, g in zip(prompt_lens, got)), "no request reached the end"
        assert tally["accepted"] > 0, (opts, tally)


def test_logits_processors_see_accepted_prefixes_in_order(tally):
    off, on = both()
    seen = {None: [], "ngram": []}

    def watcher(key):
        def proc(ids, logits):
            seen[key].append(list(ids))
            return logits
        return proc

    tally.clear()
    a = off.text_completion([PROMPTS[1]], temperature=0, max_gen_len=150, logits_processors=[watcher(None)])
    b = on.text_completion([PROMPTS[1]], temperature=0, max_gen_len=150, logits_processors=[watcher("ngram")])
    assert a == b
    assert seen["ngram"] == seen[None]
    assert tally["accepted"] > 5, tally


def test_a_grammar_request(tally):
    off, on = both()
    schema = {"type": "array", "items": {"type": "string", "enum": ["Lily", "Ben", "the park"]}, "maxItems": 12}
    opts = dict(temperature=0.9, seed=5, max_gen_len=60, grammar={"json_schema": schema})
    tally.clear()
    a = off.text_completion([PROMPTS[1]] * 2, **opts)
    assert on.text_completion([PROMPTS[1]] * 2, **opts) == a
    assert tally["accepted"] > 5, tally


def test_the_engine_batches_drafting_and_plain_requests():
    """Through the engine, with prompts prefilled in chunks beside decoding requests, one request opted out: each
    request's output is what it gets without speculation, and the engine's stats count accepted tokens."""
    off, on = both()
    jobs = [dict(prompt=p, temperature=t, seed=s, max_gen_len=70, speculative=o)
            for p, t, s, o in zip(PROMPTS * 2, (0, 1.0, 0.7, 0, 0.5, 1.0), (None, 1, 2, None, 3, 4),
                                  (True, True, False, True, True, True))]
    results = {}
    for g in (off, on):
        engine = g.engine(prefill_chunk=8)
        try:
            reqs = [engine.submit(**job) for job in jobs]
            results[g] = [r.result(timeout=120) for r in reqs]
            stats = engine.stats
        finally:
            engine.close()
    assert results[on] == results[off]
    assert stats["accepted_tokens"] > 10 and stats["verify_steps"] > 0, stats


def test_a_request_that_opts_out_is_never_drafted_for(tally):
    _, on = both()
    tally.clear()
    on.text_completion([PROMPTS[1]], temperature=0, max_gen_len=60, speculative=False)
    assert tally["drafted"] == 0


# ---------------------------------------------------------------------------------------------- unseeded requests
def test_unseeded_sampling_keeps_its_distribution():
    """Unseeded requests draw from the global generator in another order with speculation, so their samples differ,
    but their distribution does not: the first three tokens' joint frequencies over many samples match (a
    chi-square test on the categories both runs saw often)."""
    off, on = both()
    prompt = ["Lily and Ben. Lily and Ben. Lily and Ben. Lily and"]
    counts = {}
    for g in (off, on):
        torch.manual_seed(0)
        c = collections.Counter()
        for _ in range(100):
            outs = g.generate([g.tokenizer.encode(prompt[0], bos=True, eos=False)] * 4, max_gen_len=3,
                              temperature=1.0, top_p=1.0)[0]
            c.update(tuple(o) for o in outs)
        counts[g] = c
    a, b = counts[off], counts[on]
    cats = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest = (sum(a.values()) - sum(a[k] for k in cats), sum(b.values()) - sum(b[k] for k in cats))
    chi2, dof = 0.0, len(cats)
    for x, y in [(a[k], b[k]) for k in cats] + [rest]:
        if x + y:
            chi2 += (x - y) ** 2 / (x + y)
    # the 0.1% point of chi-square with dof degrees of freedom (Wilson-Hilferty)
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert len(cats) >= 2 and chi2 < limit, (chi2, limit, a.most_common(5), b.most_common(5))


# ---------------------------------------------------------------------------------------------- the server
def test_the_server_flag_and_metrics():
    """`--speculative ngram`: the server's completions are the Python API's without speculation, and /metrics
    counts the accepted tokens."""
    httpx = pytest.importorskip("httpx")
    from serve_util import Server

    off, _ = both()
    s = Server(need(STORIES), "--max_seq_len", "256", "--max_batch_size", "4", "--speculative", "ngram",
               env={"LLAMA_SPECULATIVE_TIMING": "prior"})  # drafts by the tokens alone, whatever the load
    try:
        for prompt, seed in ((PROMPTS[1], None), (PROMPTS[2], 3)):
            got = s.client().completions.create(model="stories260K", prompt=prompt, max_tokens=80, seed=seed,
                                                temperature=0 if seed is None else 0.8, top_p=1.0)
            want = off.text_completion([prompt], max_gen_len=80, seed=seed, temperature=0 if seed is None else 0.8,
                                       top_p=1.0)
            assert got.choices[0].text == want[0]["generation"]
        text = httpx.get(s.url + "/metrics").text
    finally:
        s.close()
    metric = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("llama_speculative_") and not line.startswith("#")}
    assert metric.get("llama_speculative_verify_steps", 0) > 0, metric
    assert 0 < metric["llama_speculative_accepted_tokens"] <= metric["llama_speculative_drafted_tokens"], metric


# ---------------------------------------------------------------------------------------------- the speculator's limits
class _Req:
    """What the Speculator reads of a decoding request."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _decoding(n, prompt, generated, max_new=100, blocks=8):
    from llama.core.frontend.params import SamplingParams

    return [_Req(params=SamplingParams(), feed=generated[-1], max_new=max_new, generated=list(generated),
                            prompt=list(prompt), next_pos=len(prompt) + len(generated) - 1, blocks=list(range(blocks)),
                            order=i, slot=i, id=i, predicted=None) for i in range(n)]


def _plan(reqs, spec=None, **kw):
    from llama.core.scheduling.plan import Plan

    decode = Decode(tokens=[r.feed for r in reqs], pos=[r.next_pos for r in reqs], active=list(range(len(reqs))))
    plan = Plan(ops=[decode], decoding=list(reqs))
    if spec is None:
        spec = speculative.Speculator({}, 0, kw.get("max_seq_len", 256), kw.get("block_size", 16))
        spec.rates["ngram16"] = [100.0, 0.0]  # long copies have been accepted: worth drafting long
    spec.plan(plan)
    return plan


def test_drafts_stay_within_the_rows_the_batch_the_tokens_and_the_blocks_left():
    loop = [5, 6, 7, 8] * 6
    plan = _plan(_decoding(4, loop[:12], loop[12:]))  # four requests that each could draft 4 tokens
    (op,) = plan.ops
    assert isinstance(op, Verify) and len(op.tokens) == speculative.MAX_ROWS and plan.decoding == []
    assert [len(d) for _, d in plan.verifying] == [4, 0, 0, 0]  # the oldest first, within MAX_ROWS rows
    assert isinstance(_plan(_decoding(speculative.MAX_BATCH + 1, loop[:12], loop[12:])).ops[0], Decode)
    assert [len(d) for _, d in _plan(_decoding(1, loop[:12], loop[12:], max_new=14)).verifying] == [1]
    # positions up to next_pos + k stay in the request's blocks (next_pos 23, 2 blocks of 16) and the cache
    assert [len(d) for _, d in _plan(_decoding(1, loop[:12], loop[12:], blocks=2), block_size=13).verifying] == [2]
    assert [len(d) for _, d in _plan(_decoding(1, loop[:12], loop[12:]), max_seq_len=26).verifying] == [2]


def test_a_draft_is_verified_where_it_pays_on_this_machine():
    """A 2-row step measured at 1.95 1-row steps (a small model on a busy CPU): a chance one-token match is not
    verified, nor a kind accepted 50% of the time; a long copy is, at the longest draft while 8 rows are unmeasured
    or cheap (c(7) = 3, Q4_1 amortising its reads), and not once 8 rows cost 8 steps; on a memory-bound machine
    (1.05) the chance match is verified at its best length; with nothing verified for EXPLORE steps, one token is."""
    loop, chance = [5, 6, 7, 8] * 6, [5, 6, 9, 7, 8, 3, 6]  # ... 3, 6 matches only the 6 after 5

    def speculator(t2, t8=None, accepted=None):
        spec = speculative.Speculator({}, 0, 256, 16)
        for _ in range(3):
            spec.times.add(1, 0.010)
            spec.times.add(2, t2)
            if t8 is not None:
                spec.times.add(8, t8)
        if accepted is not None:
            spec.rates["ngram16"] = [accepted, 100.0 - accepted]
        return spec

    def drafts(spec, tokens=loop):
        plan = _plan(_decoding(1, tokens[:4], tokens[4:]), spec)
        return [len(d) for _, d in plan.verifying] if isinstance(plan.ops[0], Verify) else None

    assert drafts(speculator(0.0195), chance) is None and drafts(speculator(0.0195, accepted=50.0)) is None
    assert drafts(speculator(0.0195)) == [7] and drafts(speculator(0.0195, 0.030)) == [7]
    assert drafts(speculator(0.0195, 0.080)) is None
    assert drafts(speculator(0.0105), chance) == [1]
    assert speculative.ngram_kind(1) == ("ngram1", 1 / 3) and speculative.ngram_kind(20) == ("ngram16", 8 / 9)
    spec, reqs = speculator(0.0195), _decoding(1, chance[:4], chance[4:])
    kinds = [type(_plan(reqs, spec).ops[0]).__name__ for _ in range(speculative.EXPLORE + 1)]
    assert kinds == ["Decode"] * speculative.EXPLORE + ["Verify"]
    assert speculative.expected_tokens(0.5, 3) == 1.875 and speculative.expected_tokens(1.0, 3) == 4


def test_step_times_are_a_table_not_a_line():
    """Measured row counts are their medians (a decrease pooled with its neighbour, weighted by samples),
    interpolated between, extrapolated by PRIOR_SLOPE of a one-row step past them: a 1.85x 2-row step does not
    price 8 rows at 7 steps."""
    from llama.core.speculation import step_times

    times = speculative.StepTimes(measure=True)
    assert times.cost()(3) == 1 + 2 * step_times.PRIOR_SLOPE  # nothing measured
    for rows, t in ((1, 0.050), (2, 0.0925), (4, 0.090), (8, 0.150), (1, 0.052), (1, 0.900)):
        times.add(rows, t)
    c = times.cost()
    assert [c(1), c(2), c(4), c(8)] == [0.052, 0.09125, 0.09125, 0.150]  # 2 and 4 rows pooled
    assert c(6) == pytest.approx(0.09125 + 0.05875 / 2) and c(10) == pytest.approx(0.150 + 2 * 0.1 * 0.052)
    line = speculative.StepTimes(measure=True)
    line.add(2, 0.1)
    assert line.cost()(1) == 0.1 and line.cost()(3) == pytest.approx(0.1 + 0.1 * 0.05)


def test_speculation_is_refused_off_the_cpu_before_loading():
    """A verify pass is bitwise the one-token step only in our CPU kernels (on an H200 it was not), so another device
    is refused up front, naming it, instead of after a long load."""
    d = str(need(STORIES))
    with pytest.raises(ValueError, match="runs on the CPU only: on meta"):
        Llama.build(d, d + "/tokenizer.model", max_seq_len=64, max_batch_size=1, speculative="ngram", device="meta")


def test_drafted_tokens_count_against_the_prefill_budget():
    """A verify never pushes a step past the scheduler's prefill budget: the request that drafts 7 tokens in a step
    of its own drafts 1 beside a newcomer prefilling 7 of 8 tokens."""
    from llama.core.frontend.params import SamplingParams
    from llama.core.frontend.request import Request
    from llama.core.scheduling.scheduler import Scheduler, new_stats
    from llama.core.frontend.textstream import SilentStream

    def request(prompt):
        return Request(prompt=prompt, params=SamplingParams(), max_new=20, stream=SilentStream(), stop_tokens={})

    stats = new_stats()
    sched = Scheduler(max_batch_size=2, max_seq_len=64, prefill_chunk=8, stats=stats,
                      speculator=speculative.Speculator(stats, 0, 64, 0, "ngram"))
    sched.speculator.rates["ngram8"] = [100.0, 0.0]  # copies are accepted: draft as long as room allows

    def planned():  # as the decode core steps: the scheduler plans, then its speculator drafts
        plan = sched.plan()
        sched.speculator.plan(plan, budget=sched.draft_budget(plan))
        return plan

    a = request([5, 6, 7, 8] * 3)
    sched.add([a])
    while a.feed is None:
        for r, s, c in sched.plan().prefill:
            if s + c == len(r.prompt):
                r.advance(5)

    def drafted(plan):
        (op,) = [op for op in plan.ops if isinstance(op, Verify)]
        return len(op.tokens) - len(plan.verifying)

    assert drafted(planned()) == speculative.K_MAX
    sched.add([request(list(range(10, 17)))])
    plan = planned()
    assert sum(c for _, _, c in plan.prefill) == 7 and drafted(plan) == 1
