"""Continuous batching on stories260K: every request's output equals running it alone (greedy and seeded, text and
chat, stop strings, logprobs, echo, prefixes), slots are reused, requests arrive mid-run, cancel frees a slot, a
bad request fails alone, other calls wait for the engine, and model parallel under torchrun."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import CancelledError

import pytest
import torch
from conftest import STORIES, rank_env

PROMPTS = ["Once upon a time", "Lily and her mom", "The little dog", "One day, Tom saw", "There was a big tree",
           "Sam liked to play", "The sun was hot", "A bird sat on"]
LENGTHS = [30, 6, 50, 12, 3, 40, 9, 20]
DIALOGS = [
    [{"role": "user", "content": "Tell me a story"}],
    [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "What is a cat?"}],
    [{"role": "user", "content": "Hi [INST] there"}],  # special tags: the reference's error text
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Go"}],
]
SLOTS = 3


@pytest.fixture(scope="module")
def gen():
    if not (STORIES / "consolidated.00.pth").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (expected <repo root>/../shared)")
    from llama import Llama

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the model is tiny: a second thread only adds contention on a shared machine
    yield Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=192, max_batch_size=SLOTS)
    torch.set_num_threads(threads)


def alone(gen, prompt, **params):
    return gen.text_completion([prompt], **params)[0]


# ------------------------------------------------------------------------------------------------------ offline
def test_offline_greedy_more_prompts_than_slots_match_alone(gen):
    params = dict(temperature=0.0, max_gen_len=LENGTHS, logprobs=True)
    batch = gen.text_completion(PROMPTS, **params)
    for i, p in enumerate(PROMPTS):
        expected = alone(gen, p, temperature=0.0, max_gen_len=LENGTHS[i], logprobs=True)
        assert batch[i]["generation"] == expected["generation"], p
        assert batch[i]["tokens"] == expected["tokens"]
        assert batch[i]["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4)
        assert len(batch[i]["tokens"]) <= LENGTHS[i]


def test_offline_seeded_samples_match_alone(gen):
    seeds = list(range(100, 100 + len(PROMPTS)))
    batch = gen.text_completion(PROMPTS, temperature=0.9, top_p=0.95, top_k=40, seed=seeds, max_gen_len=LENGTHS, n=2)
    assert len(batch) == 2 * len(PROMPTS)
    for i, p in enumerate(PROMPTS):
        expected = gen.text_completion([p], temperature=0.9, top_p=0.95, top_k=40, seed=seeds[i],
                                       max_gen_len=LENGTHS[i], n=2)
        assert batch[2 * i : 2 * i + 2] == expected, p


def test_offline_chat_stop_echo_and_prefix_match_alone(gen):
    chats = gen.chat_completion(DIALOGS, temperature=0.0, max_gen_len=25)
    for d, got in zip(DIALOGS, chats):
        assert got == gen.chat_completion([d], temperature=0.0, max_gen_len=25)[0]
    assert chats[2]["generation"]["content"].startswith("Error: special tags")

    stopped = gen.text_completion(PROMPTS, temperature=0.0, max_gen_len=60, stop=["."])
    for p, got in zip(PROMPTS, stopped):
        assert got == alone(gen, p, temperature=0.0, max_gen_len=60, stop=["."])
        assert "." not in got["generation"]

    echo = gen.text_completion(PROMPTS[:5], temperature=0.0, max_gen_len=8, echo=True, logprobs=True)
    for p, got in zip(PROMPTS[:5], echo):
        expected = alone(gen, p, temperature=0.0, max_gen_len=8, echo=True, logprobs=True)
        assert got["generation"] == expected["generation"] and got["generation"].startswith(p)
        assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4)

    prefix = gen.prefill("Once upon a time, there was a")
    tails = [" dog", " cat named", " girl", " big", " red ball"]
    with_prefix = gen.text_completion(tails, prefix=prefix, temperature=0.0, max_gen_len=15)
    for t, got in zip(tails, with_prefix):
        assert got == gen.text_completion([t], prefix=prefix, temperature=0.0, max_gen_len=15)[0]
    scored = gen.text_completion(tails, prefix=prefix, temperature=0.0, max_gen_len=4, echo=True, logprobs=True)
    for t, got in zip(tails, scored):
        expected = gen.text_completion([t], prefix=prefix, temperature=0.0, max_gen_len=4, echo=True, logprobs=True)[0]
        assert got["tokens"] == expected["tokens"]
        assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4)


# ------------------------------------------------------------------------------------------------------ online
def test_online_requests_match_alone_and_reuse_slots(gen):
    requests = [(p, dict(temperature=0.0, max_gen_len=n)) for p, n in zip(PROMPTS, LENGTHS)]
    requests += [(p, dict(temperature=0.8, seed=7 + i, max_gen_len=25)) for i, p in enumerate(PROMPTS[:3])]
    requests += [(d, dict(temperature=0.0, max_gen_len=20)) for d in DIALOGS]
    with gen.engine(prefill_chunk=8) as engine:  # a small chunk: prompts take several steps to prefill
        handles = [engine.submit(p, **kw) for p, kw in requests]
        streamed = "".join(handles[0])
        results = [h.result(timeout=60) for h in handles]
    for (p, kw), got in zip(requests, results):
        if isinstance(p, str):
            assert got == alone(gen, p, **kw), p
        else:
            assert got == gen.chat_completion([p], **kw)[0], p
    assert streamed == results[0]["generation"]
    stats = engine.stats
    assert stats["admitted"] == len(requests) - 1  # the unsafe dialog never needs a slot
    assert stats["peak_active"] == SLOTS  # slots were reused, never exceeded
    assert stats["finished"] == stats["admitted"]
    assert all(r is None for r in engine.slots)


def test_online_prompts_continue_a_prefix(gen):
    prefix = gen.prefill("Once upon a time there was a dog named Max. Max liked bones.")
    prompts = [" One day, Max", " Lily saw the dog", " The end"]
    with gen.engine(prefill_chunk=8) as engine:
        handles = [engine.submit(p, prefix=prefix, temperature=0.0, max_gen_len=12) for p in prompts]
        bad = engine.submit([{"role": "user", "content": "hi"}], prefix=prefix)
        results = [h.result(timeout=60) for h in handles]
    assert results == gen.text_completion(prompts, prefix=prefix, temperature=0.0, max_gen_len=12)
    with pytest.raises(ValueError, match="prefix applies to text or token prompts"):
        bad.result(timeout=60)


def test_prompt_longer_than_the_chunk_alone(gen):
    prompt = "Once upon a time, there was a little girl named Lily."
    with gen.engine(prefill_chunk=3) as engine:  # several steps with nothing to sample
        got = engine.submit(prompt, temperature=0.0, max_gen_len=12).result(timeout=60)
    assert got == alone(gen, prompt, temperature=0.0, max_gen_len=12)
    n = len(gen.tokenizer.encode(prompt, bos=True, eos=False))
    assert engine.stats["steps"] == -(-n // 3) + 11  # ceil(n / 3) prefill steps (the last samples), 11 decodes


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(gen):
    long_prompt = " ".join(["The cat sat on the mat and looked at the sun."] * 7)
    n_long = len(gen.tokenizer.encode(long_prompt, bos=True, eos=False))
    assert 100 < n_long < 192
    engine = gen.engine(prefill_chunk=16)
    seen = {}
    with gen.lock:  # hold the engine back so both requests are in its first step
        short = engine.submit("Once upon a time", temperature=0.0, max_gen_len=8)
        long = engine.submit(long_prompt, temperature=0.0, max_gen_len=5)
        short.add_done_callback(lambda h: seen.update(engine.stats))
    assert short.result(timeout=60) == alone(gen, "Once upon a time", temperature=0.0, max_gen_len=8)
    assert long.result(timeout=60) == alone(gen, long_prompt, temperature=0.0, max_gen_len=5)
    engine.close()
    # The short request generated all its tokens while the long prompt was still being prefilled.
    assert seen["prefill_tokens"] < n_long
    assert engine.stats["prefill_tokens"] == n_long + 5


class Gate:
    """A logits processor that holds the engine at its first call until the test releases it, so the test acts
    at a known step instead of racing the engine thread."""

    def __init__(self):
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, tokens, logits):
        self.reached.set()
        if not self.release.wait(30):
            raise TimeoutError("the test never released the gate")
        return logits


def test_request_submitted_mid_run_is_served(gen):
    gate, order = Gate(), []
    with gen.engine() as engine:
        first = engine.submit("Once upon a time", temperature=0.0, max_gen_len=120, logits_processors=gate)
        assert gate.reached.wait(30)  # the first request is running
        late = engine.submit("The little dog", temperature=0.0, max_gen_len=10)
        for h in (first, late):
            h.add_done_callback(lambda h: order.append(h))
        gate.release.set()
        late_result, first_result = late.result(timeout=60), first.result(timeout=60)
    assert order == [late, first]  # admitted into a free slot while the first kept generating
    assert late_result == alone(gen, "The little dog", temperature=0.0, max_gen_len=10)
    assert first_result == alone(gen, "Once upon a time", temperature=0.0, max_gen_len=120)
    assert "".join(first) == first_result["generation"]


def test_cancel_frees_a_slot(gen):
    engine, gate, seen = gen.engine(), Gate(), {}
    with gen.lock:  # fill every slot with long requests, one short request waits
        longs = [engine.submit(p, temperature=0.0, max_gen_len=180, logits_processors=gate if i == 0 else ())
                 for i, p in enumerate(PROMPTS[:SLOTS])]
        waiting = engine.submit("The sun was hot", temperature=0.0, max_gen_len=5)
    waiting.add_done_callback(lambda h: seen.update(others_done=[longs[1].done(), longs[2].done()]))
    assert gate.reached.wait(30)
    assert longs[0].cancel()
    gate.release.set()
    assert waiting.result(timeout=60) == alone(gen, "The sun was hot", temperature=0.0, max_gen_len=5)
    assert seen["others_done"] == [False, False]  # it got the cancelled request's slot
    with pytest.raises(CancelledError):
        longs[0].result()
    assert longs[0].finish_reason == "cancelled"
    engine.close(cancel=True)
    assert all(h.done() for h in longs) and all(r is None for r in engine.slots)
    assert not longs[0].cancel()  # already finished


def test_bad_requests_fail_alone(gen):
    with gen.engine() as engine:
        good = engine.submit("Once upon a time", temperature=0.0, max_gen_len=20)
        too_long = engine.submit("word " * 400, temperature=0.0)
        bad_temp = engine.submit("Lily", temperature=-1.0)
        unknown = engine.submit("Lily", temprature=0.5)
        bad_dialog = engine.submit([{"role": "robot", "content": "hi"}])
        failing = engine.submit("The dog", temperature=0.0, logits_processors=lambda toks, logits: 1 / 0)
        good2 = engine.submit("The little dog", temperature=0.0, max_gen_len=20)
        assert good.result(timeout=60) == alone(gen, "Once upon a time", temperature=0.0, max_gen_len=20)
        assert good2.result(timeout=60) == alone(gen, "The little dog", temperature=0.0, max_gen_len=20)
    with pytest.raises(ValueError, match=r"has \d+ tokens; it must be shorter than max_seq_len=192"):
        too_long.result()
    with pytest.raises(ValueError, match="temperature"):
        bad_temp.result()
    with pytest.raises(TypeError, match="temprature"):
        unknown.result()
    with pytest.raises(ValueError, match="dialog"):
        bad_dialog.result()
    with pytest.raises(ValueError, match="logits processor"):
        failing.result()
    closed = engine.submit("Lily", temperature=0.0)
    with pytest.raises(RuntimeError, match="closed"):
        closed.result()


def test_an_engine_that_dies_fails_every_request_and_refuses_new_ones(gen):
    """An error outside any one request (here the scheduler's planning) stops the engine's thread: every queued
    and running request fails with the cause instead of waiting forever, and later submissions are refused."""
    engine = gen.engine()
    plan, calls = engine.scheduler.plan, []

    def failing_plan():
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("lost the model-parallel peer")
        return plan()

    engine.scheduler.plan = failing_plan
    reqs = [engine.submit(p, temperature=0.0, max_gen_len=100) for p in PROMPTS[:SLOTS + 2]]
    for r in reqs:
        with pytest.raises(RuntimeError, match="engine stopped after an error.*lost the model-parallel peer"):
            r.result(timeout=60)
        assert r.finish_reason == "error"
    streamed = reqs[0]
    with pytest.raises(RuntimeError, match="lost the model-parallel peer"):
        "".join(streamed)  # an iterator ends with the error too
    assert not engine.alive and "lost the model-parallel peer" in repr(engine.error)
    late = engine.submit("Lily", temperature=0.0)
    with pytest.raises(RuntimeError, match="engine stopped after an error"):
        late.result(timeout=5)
    engine.close()
    assert gen.text_completion(["Lily"], temperature=0.0, max_gen_len=8)  # the generator itself still works


def test_other_calls_wait_until_the_engine_is_idle(gen):
    engine, gate, finished = gen.engine(), Gate(), []
    handles = [engine.submit(p, temperature=0.0, max_gen_len=40, logits_processors=gate if i == 0 else ())
               for i, p in enumerate(PROMPTS[:5])]
    for h in handles:
        h.add_done_callback(lambda h: finished.append(h))
    assert gate.reached.wait(30)  # the engine thread owns the cache now
    gate.release.set()
    got = gen.text_completion(["Sam liked to play"], temperature=0.0, max_gen_len=15)[0]
    assert len(finished) == len(handles)  # text_completion ran only once the engine was idle
    engine.close()
    assert got == alone(gen, "Sam liked to play", temperature=0.0, max_gen_len=15)
    for p, h in zip(PROMPTS, handles):
        assert h.result() == alone(gen, p, temperature=0.0, max_gen_len=40)


def test_submit_from_many_threads(gen):
    results = {}
    with gen.engine() as engine:

        def client(i):
            results[i] = engine.submit(PROMPTS[i], temperature=0.0, max_gen_len=LENGTHS[i]).result(timeout=60)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, p in enumerate(PROMPTS):
        assert results[i] == alone(gen, p, temperature=0.0, max_gen_len=LENGTHS[i])


@pytest.mark.parametrize("cuda", [False, True])
def test_compiled_decode_step_spans_the_slots_in_use(gen, monkeypatch, cuda):
    """With a compiled decode step (llama.compilation.compiled_decode) on CPU the engine decodes over slots 0..highest active, rounded
    up to a graph's batch size (bucket: 1, 2, then all 3 slots), rows in place; not over every slot, so the last
    request left does not pay for three rows. On CUDA every step spans every slot (one graph). The step is stood in
    for by the eager decode_step it would compile."""
    sizes = []

    class Step:  # CompiledDecode's interface, already compiled for every size
        lazy = False
        cuda = False
        seen = {}  # the graphs compiled so far (Runner.compiles): none during the run

        def key(self, batch, rows):
            return batch, rows is not None

        def ready(self, key):
            return True

        def __call__(self, tokens, pos, rows=None):
            sizes.append((tokens.shape[0], rows is None))
            return gen.model.decode_step(tokens, pos, rows)

    step = Step()
    step.cuda = cuda  # only the width rule reads it; the model stays on the CPU
    monkeypatch.setattr(gen.runner, "compiled", step)
    with gen.engine() as engine:
        handles = [engine.submit(p, temperature=0.0, max_gen_len=n) for p, n in zip(PROMPTS, LENGTHS)]
        results = [h.result(timeout=60) for h in handles]
    monkeypatch.setattr(gen.runner, "compiled", None)
    assert {rows for _, rows in sizes} == {True} and len(sizes) >= max(LENGTHS) - 1
    if cuda:
        assert {b for b, _ in sizes} == {SLOTS}
    else:
        assert {b for b, _ in sizes} <= {1, 2, SLOTS} and SLOTS in {b for b, _ in sizes}
        assert min(b for b, _ in sizes) < SLOTS  # the tail: fewer requests than slots
    for p, n, got in zip(PROMPTS, LENGTHS, results):
        assert got == alone(gen, p, temperature=0.0, max_gen_len=n)


def test_auto_compile_still_eager_decodes_only_the_slots_in_use(gen, monkeypatch):
    """compile="auto" before its graph is due: steps span only the slots in use, and their time counts toward
    compiling the graph that would serve them (one request in slot 0: the batch-1 graph on CPU; on CUDA one graph
    spans every slot)."""
    from llama.compilation.compiled_decode import CompiledDecode

    step = CompiledDecode(gen.model, "default", lazy=True)
    step.estimate = float("inf")  # never due in this test: nothing is compiled
    widths = []
    forward = gen.model.forward
    monkeypatch.setattr(gen.runner, "compiled", step)
    monkeypatch.setattr(gen.model, "forward", lambda x, *a, **k: widths.append(x.shape) or forward(x, *a, **k))
    with gen.engine() as engine:
        result = engine.submit(PROMPTS[0], temperature=0.0, max_gen_len=12).result(timeout=60)
    monkeypatch.setattr(gen.runner, "compiled", None)
    assert result == alone(gen, PROMPTS[0], temperature=0.0, max_gen_len=12)
    assert (1, 1) in widths and (SLOTS, 1) not in widths  # one request: one-row decode steps
    # The time counts toward the graph that would serve this step: batch 1 on CPU, every slot on CUDA (one graph).
    graph = (SLOTS if step.cuda else 1, False)
    assert step.eager.keys() == {graph} and step.eager[graph] > 0 and not step.seen


# ------------------------------------------------------------------------------------------------------ model parallel
MP_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    import torch.distributed as dist
    from llama import Llama

    torch.set_num_threads(1)
    ckpt, out = sys.argv[1:]
    prompts = ["Once upon a time", "The little dog", "Lily and her mom", "One day, Tom saw", "The sun was hot"]
    lengths = [20, 5, 15, 8, 12]
    g = Llama.build(ckpt, ckpt + "/tokenizer.model", max_seq_len=128, max_batch_size=2, device="cpu")
    engine = g.engine(prefill_chunk=4)
    engine.HEARTBEAT = 0.1  # idle rank 0 sends empty steps: the followers must take them in stride
    rank = dist.get_rank()
    result = {"rank": rank}
    if rank == 0:
        engine.submit("Lily", temperature=0.0, max_gen_len=3).result()
        time.sleep(0.5)
        hs = [engine.submit(p, temperature=0.8, seed=i, max_gen_len=n) for i, (p, n) in enumerate(zip(prompts, lengths))]
        hs.append(engine.submit("A bird sat on", temperature=0.8, max_gen_len=10))  # unseeded: uses rank 0's RNG
        result["online"] = [h.result() for h in hs[:-1]]
        hs[-1].result()
        engine.close()
    else:
        try:
            engine.submit("Lily")
        except RuntimeError as e:
            result["submit_error"] = str(e)
        engine.serve_forever()
    result["alone"] = [g.text_completion([p], temperature=0.8, seed=i, max_gen_len=n)[0]
                       for i, (p, n) in enumerate(zip(prompts, lengths))]
    result["offline"] = g.text_completion(prompts, temperature=0.8, seed=list(range(5)), max_gen_len=lengths)
    result["unseeded"] = g.text_completion(prompts, temperature=0.8, max_gen_len=lengths)  # RNG agrees across ranks
    json.dump(result, open(f"{out}.{rank}.json", "w"))
    dist.barrier()
    dist.destroy_process_group()
""")


def test_model_parallel_rank0_schedules_and_ranks_follow(gen, tmp_path):
    (tmp_path / "run.py").write_text(MP_SCRIPT)
    env = rank_env(2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "run.py"), str(STORIES), str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        _, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in 180 s: {err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    r0, r1 = (json.loads((tmp_path / f"out.{k}.json").read_text()) for k in (0, 1))
    assert r0["online"] == r0["alone"] == r0["offline"][: len(r0["alone"])]
    assert r0["offline"] == r0["alone"]
    assert r1["alone"] == r0["alone"] and r1["offline"] == r0["offline"]
    assert r1["unseeded"] == r0["unseeded"]
    assert "only model-parallel rank 0 accepts requests" in r1["submit_error"]


def test_handle_is_a_deprecated_alias_of_request():
    """Code written for the engine's old `Handle` still runs, and is told the new name."""
    import llama
    from llama.core.frontend import request

    for module in (llama, request):
        with pytest.warns(DeprecationWarning, match="llama.Request"):
            assert module.Handle is llama.Request
    with pytest.raises(AttributeError, match="Handel"):
        llama.Handel
