"""The scheduler alone, with no model and no tensors: the exact typed ops it plans step by step for admission,
compaction, chunked prefill, n-sample twins and prefixes; ops survive pickling (how followers get them); the runner
dispatches on their type; and the core imports neither the runner from the scheduler nor any llama.distributed
module."""

import ast
import pickle
from types import SimpleNamespace

import pytest
from conftest import REPO

from llama.core.frontend.params import SamplingParams
from llama.core.scheduling.plan import CopyRows, Decode, LoadPrefix, Prefill
from llama.core.frontend.request import Request
from llama.core.worker.runner import Runner
from llama.core.scheduling.scheduler import Scheduler
from llama.core.frontend.textstream import SilentStream

TOKEN = 9  # what every step "samples"



def request(length: int, max_new: int, first: int = 1, prefix=None) -> Request:
    return Request(prompt=list(range(first, first + length)), params=SamplingParams(), max_new=max_new,
                   stream=SilentStream(), stop_tokens={}, prefix=prefix)


def twins(length: int, max_new: int, n: int):
    """n samples of one prompt, linked as RequestBuilder links them."""
    reqs = [request(length, max_new) for _ in range(n)]
    for r in reqs[1:]:
        r.twin, reqs[0].has_twins = reqs[0], True
    return reqs


def step(sched: Scheduler) -> list:
    """Plan one step, then do what the runner and the core do with it (without logits): every request with a
    token now (prompt complete, twin copied, decoded) advances, and finished ones retire. Returns the ops."""
    plan = sched.plan()
    ready = [r for r, s, c in plan.prefill if s + c == len(r.prompt)]
    ready += [r for r, _ in plan.twins] + plan.decoding
    for r in ready:
        r.advance(TOKEN)
    for r in sched.running():
        if r.finished:
            sched.retire(r)
    return plan.ops


def test_admission_fills_slots_longest_first_then_reuses_freed_ones():
    sched = Scheduler(max_batch_size=2, max_seq_len=32, prefill_chunk=64)
    a, b, c = request(3, max_new=1, first=10), request(2, max_new=3, first=20), request(4, max_new=2, first=30)
    sched.add([a, b, c], longest_first=True)
    assert list(sched.waiting) == [b, c, a]

    assert step(sched) == [Prefill(tokens=[[20, 21, 0, 0], [30, 31, 32, 33]], start=0, rows=[0, 1], last=[1, 3],
                                   kv_len=4)]
    assert (b.slot, c.slot) == (0, 1) and list(sched.waiting) == [a]
    assert step(sched) == [Decode(tokens=[TOKEN, TOKEN], pos=[2, 4], active=[0, 1])]  # a waits: no free slot
    assert c.finished and sched.slots == [b, None]
    # a takes c's freed slot; its prompt is prefilled while b decodes (slot 1 rides along at a dummy position)
    assert step(sched) == [Prefill(tokens=[[10, 11, 12]], start=0, rows=[1], last=[2], kv_len=3),
                           Decode(tokens=[TOKEN, 0], pos=[3, 3], active=[0])]
    assert a.finished and b.finished and not sched.has_work()
    assert sched.stats["admitted"] == 3 and sched.stats["finished"] == 3


def test_requests_keep_their_order_unless_longest_first():
    sched = Scheduler(max_batch_size=1, max_seq_len=32, prefill_chunk=64)
    short, long = request(2, max_new=1), request(2, max_new=5)
    sched.add([short, long])
    assert list(sched.waiting) == [short, long]


def test_compaction_moves_busy_slots_down_so_decode_reads_slots_0_to_b():
    sched = Scheduler(max_batch_size=3, max_seq_len=32, prefill_chunk=64, base=4)  # rows 4..6 of the cache
    r0, r1, r2 = request(2, max_new=1, first=1), request(2, max_new=4, first=3), request(2, max_new=4, first=5)
    sched.add([r0, r1, r2])
    assert step(sched) == [Prefill(tokens=[[1, 2], [3, 4], [5, 6]], start=0, rows=[4, 5, 6], last=[1, 1, 1],
                                   kv_len=2)]
    assert r0.finished and sched.slots == [None, r1, r2]
    # nobody waits: r2 moves from slot 2 into the free slot 0 (its 2 cached positions), then decode spans slots 0-1
    assert step(sched) == [CopyRows(src=[6], dst=[4], length=2),
                           Decode(tokens=[TOKEN, TOKEN, 0], pos=[2, 2, 0], active=[0, 1], base=4)]
    assert sched.slots == [r2, r1, None] and r2.slot == 0 and sched.stats["moves"] == 1
    assert step(sched) == [Decode(tokens=[TOKEN, TOKEN, 0], pos=[3, 3, 0], active=[0, 1], base=4)]


def test_no_compaction_while_requests_wait():
    """A waiting request will take the free slot: moving someone into it would copy for nothing."""
    sched = Scheduler(max_batch_size=3, max_seq_len=32, prefill_chunk=64)
    r0, r1, r2 = request(2, max_new=1), request(2, max_new=4), request(2, max_new=4)
    sched.add([r0, r1, r2])
    step(sched)
    sched.add(twins(2, max_new=1, n=2))  # two samples, one free slot: they wait (together)
    assert step(sched) == [Decode(tokens=[0, TOKEN, TOKEN], pos=[0, 2, 2], active=[1, 2])]
    assert sched.slots == [None, r1, r2] and sched.stats["moves"] == 0


def test_chunked_prefill_gives_the_budget_to_the_oldest_request_first():
    sched = Scheduler(max_batch_size=2, max_seq_len=32, prefill_chunk=4)
    a, b = request(6, max_new=2, first=10), request(3, max_new=2, first=20)
    sched.add([a, b])
    assert step(sched) == [Prefill(tokens=[[10, 11, 12, 13]], start=0, rows=[0], last=[3], kv_len=4)]
    assert (a.prefilled, b.prefilled) == (4, 0)  # b is admitted but gets no tokens this step
    assert step(sched) == [Prefill(tokens=[[14, 15], [20, 21]], start=[4, 0], rows=[0, 1], last=[1, 1], kv_len=6)]
    assert a.feed == TOKEN and b.feed is None
    assert step(sched) == [Prefill(tokens=[[22]], start=2, rows=[1], last=[0], kv_len=3),
                           Decode(tokens=[TOKEN, 0], pos=[6, 3], active=[0])]
    assert a.finished and sched.slots == [None, b]
    assert step(sched) == [CopyRows(src=[1], dst=[0], length=3), Decode(tokens=[TOKEN, 0], pos=[3, 0], active=[0])]
    assert b.finished and not sched.has_work()
    assert sched.stats["prefill_tokens"] == 9


def test_twins_are_admitted_together_and_copy_their_source_prompt_once_it_is_cached():
    sched = Scheduler(max_batch_size=3, max_seq_len=32, prefill_chunk=2)
    x = request(2, max_new=2, first=50)
    r0, r1, r2 = twins(3, max_new=1, n=3)
    sched.add([x])
    sched.add([r0, r1, r2])
    assert step(sched) == [Prefill(tokens=[[50, 51]], start=0, rows=[0], last=[1], kv_len=2)]
    assert list(sched.waiting) == [r0, r1, r2]  # two slots are free, three samples: they wait together
    assert step(sched) == [Decode(tokens=[TOKEN, 0, 0], pos=[2, 0, 0], active=[0])]
    assert x.finished
    # all three admitted; only the first sample's prompt is computed, in two chunks; the others wait for it
    assert step(sched) == [Prefill(tokens=[[1, 2]], start=0, rows=[0], last=[1], kv_len=2)]
    assert [r.slot for r in (r0, r1, r2)] == [0, 1, 2] and (r1.prefilled, r2.prefilled) == (0, 0)
    assert step(sched) == [Prefill(tokens=[[3]], start=2, rows=[0], last=[0], kv_len=3),
                           CopyRows(src=[0], dst=[1], length=3), CopyRows(src=[0], dst=[2], length=3)]
    assert all(r.finished for r in (r0, r1, r2)) and sched.stats["prefill_tokens"] == 2 + 3


def test_a_prefix_is_loaded_then_only_the_rest_of_the_prompt_is_prefilled():
    prefix = SimpleNamespace(id=7, reusable=lambda prompt: 2)
    sched = Scheduler(max_batch_size=2, max_seq_len=32, prefill_chunk=64)
    r = request(4, max_new=1, first=1, prefix=prefix)
    sched.add([r])
    assert step(sched) == [LoadPrefix(prefix=7, row=0, length=2),
                           Prefill(tokens=[[3, 4]], start=2, rows=[0], last=[1], kv_len=4)]
    assert r.reused == 2


def test_ops_are_small_plain_data_that_pickle():
    ops = [LoadPrefix(prefix=7, row=0, length=2), CopyRows(src=[2], dst=[0], length=5),
           Prefill(tokens=[[1, 2]], start=[0], rows=[0], last=None, kv_len=2),
           Decode(tokens=[1, 0], pos=[3, 0], active=[0], base=2)]
    assert pickle.loads(pickle.dumps(ops)) == ops
    assert len(pickle.dumps(ops)) < 600


def test_the_runner_dispatches_on_the_op_type():
    calls = []
    cache = SimpleNamespace(device="cpu", copy_rows=lambda *a: calls.append(("copy", a)),
                            prefix=lambda i: SimpleNamespace(blocks=[i, i + 1]),
                            continue_prefix=lambda *a: calls.append(("load", a)))
    runner = Runner(None, cache)
    assert runner.execute([CopyRows(src=[2], dst=[0], length=5), LoadPrefix(prefix=7, row=1, length=3)]) == [None, None]
    assert calls == [("copy", ([2], [0], 5)), ("load", ([7, 8], 1, 3))]
    with pytest.raises(TypeError, match="unknown op"):
        runner.execute([{"kind": "copy", "src": [2], "dst": [0], "length": 5}])


def imports(path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def test_the_scheduler_plans_without_the_runner_and_the_core_without_llama_distributed():
    core = REPO / "llama" / "core"
    assert "llama.core.scheduling.plan" in imports(core / "scheduling" / "scheduler.py")
    assert "llama.core.worker.runner" not in imports(core / "scheduling" / "scheduler.py")
    used = {str(p.relative_to(core)): sorted(m for m in imports(p) if m.startswith("llama.distributed"))
            for p in core.rglob("*.py")}
    assert len(used) > 20
    assert {name: mods for name, mods in used.items() if mods} == {}
