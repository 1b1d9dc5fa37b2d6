"""Pipeline parallel under torchrun on CPU (gloo): P=2 (2 processes) gives the stories260K goldens and the single
process's seeded samples from 1- and 2-shard checkpoints, each rank holds about 1/(T x P) of the weights, the engine
under P=2 serves concurrent requests as each alone (its steps overlapping across the stages, and one step at a
time), also when they arrive at different times, one is cancelled and others fail, and impossible layouts fail with
a clear ValueError. T=2 x P=2 on two simulated nodes: test_pipeline_nodes.py (a file of its own, so that two pytest
workers share the launches)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GOLDENS, ON_CUDA, SHARED, STORIES, error_lines, rank_env
from helpers import ONCE, build_stories

TESTS = Path(__file__).resolve().parent
ROOT_TESTS = TESTS.parent
TIMEOUT = 240
MAX_SEQ_LEN, MAX_BATCH = 256, 2
# The engine's requests: (prompt, sampling parameters); run concurrently through the engine, then each alone.
ENGINE_REQUESTS = [
    (ONCE, dict(temperature=0.0, max_gen_len=40)),
    ("Lily and her mom", dict(temperature=1.0, top_p=0.9, seed=5, max_gen_len=30)),
    ("The little dog", dict(temperature=0.8, seed=9, max_gen_len=50, stop=["."])),
    ("One day, Tom saw", dict(temperature=0.0, max_gen_len=12)),
]

# The pipelined engine's staggered run (2 groups of 2 slots): these arrive first, then LATER once the first has a
# token, beside a request that is cancelled and two that fail.
STAGGERED = [
    (ONCE, dict(temperature=0.0, max_gen_len=60)),
    ("Lily and her mom", dict(temperature=1.0, top_p=0.9, seed=5, max_gen_len=30)),
    ("The little dog", dict(temperature=0.8, seed=9, max_gen_len=50, stop=["."])),
]
LATER = [
    ("One day, Tom saw", dict(temperature=0.0, max_gen_len=12)),
    ("Ben had a red ball", dict(temperature=0.7, seed=2, max_gen_len=45)),
    ("The sun was", dict(temperature=0.0, max_gen_len=25)),
]

# Prompts sharing a 2-block start (stories' tokenizer): the calls and the pipelined engine with the prefix cache on
# (the default) must give the text of one process with it off.
COMMON_START = "Tom and his friend Sam went to the big park to play with a red ball and a kite on a sunny day."
SHARED_PROMPTS = [COMMON_START + t for t in (" One day", " Sam saw", " The ball", " Then")]
SHARED_OPTS = dict(temperature=0.0, max_gen_len=12)


def broken_after_3(ids, logits):
    """A logits processor that fails once its request has 3 tokens: that request fails mid-way, alone."""
    if len(ids) >= 3:
        raise RuntimeError("boom")
    return logits


# Run by every rank: python -c ... T P OUT MODE DIR...
SCRIPT = f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(ROOT_TESTS)!r}]; import test_pipeline; test_pipeline.rank_main(sys.argv[1:])"


def generations(g) -> dict:
    """Sampled (first call after build: the global RNG is just seeded) and greedy ids of the goldens' prompts."""
    prompts = [v["prompt_tokens"] for v in json.loads(GOLDENS.read_text()).values()]
    sampled, _ = g.generate(prompts, max_gen_len=48, temperature=0.8, top_p=0.9)
    greedy, _ = g.generate(prompts, max_gen_len=128, temperature=0.0)
    return {"sampled": sampled, "greedy": greedy}


def extras(g) -> dict:
    """Seeded, streamed, stopped and chat-session outputs (test_distributed's), a failing logits processor (it runs
    on the last stage; its failure reaches every rank) and echoed prompt log-probabilities (logits to every rank)."""
    from test_tensor_parallel import mp_outputs

    from llama.core.frontend.request import BatchError

    def broken(ids, logits):
        raise RuntimeError("boom")

    out = {"mp": mp_outputs(g)}
    try:
        g.text_completion([ONCE, "Lily"], temperature=0.0, max_gen_len=5, logits_processors=[[broken], []])
    except BatchError as e:
        out["failed"] = [e.predictions, sorted(e.errors), all("boom" in str(x) for x in e.errors.values())]
    out["echo"] = g.text_completion(["Lily went"], temperature=0.0, max_gen_len=4, echo=True, logprobs=True)
    prefix = g.prefill(ONCE)  # each stage snapshots its own layers; the load op replays on every rank
    out["prefix"] = g.text_completion([" there", " Tom"], prefix=prefix, temperature=0.0, max_gen_len=10)
    out["score"] = g.score([ONCE + " there was a cat"])[0]["logprobs"]
    # A 209-token prompt: prefill passes this long are cut into sequence chunks that the stages work on at once
    long = " ".join(["Once upon a time there was a little girl named Lily who liked to play in the park."] * 8)
    out["long"] = g.text_completion([long, "Tom and"], temperature=0.9, seed=[3, 4], max_gen_len=30)
    out["long_score"] = g.score([long])[0]["logprobs"]
    return out


def shared_prefix(g, rank: int) -> dict:
    """SHARED_PROMPTS as Llama calls, each after the last (the later ones reuse cached blocks on every rank alike),
    then all at once through the pipelined engine (rank 0 plans the hits, the other stage applies its tables)."""
    out = {"calls": [g.text_completion([p], **SHARED_OPTS)[0]["generation"] for p in SHARED_PROMPTS]}
    engine = g.engine()
    if rank == 0:
        reqs = [engine.submit(p, **SHARED_OPTS) for p in SHARED_PROMPTS]
        out["served"] = [r.result(timeout=120)["generation"] for r in reqs]
        out["reused"] = [r.reused for r in reqs]
        engine.close()
    else:
        engine.serve_forever()
    out["cached_tokens"] = g.cache.pool.stats["cached_tokens"]
    return out


def alone(g) -> list:
    return [g.text_completion([p], **params)[0] for p, params in ENGINE_REQUESTS]


def first_delta(request) -> None:
    """Block until the request has produced some text (or finished)."""
    next(iter(request), None)


def staggered(d: str, rank: int) -> dict:
    """The pipelined engine on a 4-slot build (two groups of 2): STAGGERED at once, LATER once the first has a
    token, a long request cancelled after its first token, one whose logits processor fails mid-way and one
    refused at submit (its prompt is longer than max_seq_len). Each request's output alone, from the same build."""
    from llama import Llama

    g = Llama.build(d, str(STORIES / "tokenizer.model"), max_seq_len=MAX_SEQ_LEN, max_batch_size=4,
                    pipeline_parallel_size=2, device="cpu", dtype="float32")
    out = {"alone": [g.text_completion([p], **params)[0] for p, params in STAGGERED + LATER]}
    engine = g.engine()
    if rank != 0:
        engine.serve_forever()
        return out
    with g.cache.lock:  # the engine's first step waits for all three (it holds the cache lock to step): both groups
        first = [engine.submit(p, **params) for p, params in STAGGERED]  # start together however busy the CPU
    first_delta(first[0])
    doomed = engine.submit(ONCE, temperature=0.0, max_gen_len=200)
    bad = engine.submit("Tom", temperature=0.0, max_gen_len=20, logits_processors=[broken_after_3])
    too_long = engine.submit("Once " * 300, max_gen_len=5)
    later = [engine.submit(p, **params) for p, params in LATER]
    first_delta(doomed)
    doomed.cancel()
    out["engine"] = [r.result(timeout=120) for r in first + later]
    out["errors"] = [type(r.exception(timeout=120)).__name__ + ": " + str(r.exception()) for r in (doomed, bad, too_long)]
    engine.close()
    out.update(stats=engine.stats, trace=engine._pipe.trace, slots=len(engine.groups[1].slots),
               base=engine.groups[1].base)
    return out


GGUF = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def gguf_outputs(g) -> dict:
    from llama.distributed.pipeline import weight_bytes

    out = g.text_completion(GGUF_PROMPTS, temperature=0.0, max_gen_len=12)
    return {"greedy": [o["generation"] for o in out], "weight_bytes": weight_bytes(g.model)}


def rank_main(argv) -> None:
    """One rank of a pipeline job: a .gguf among the paths is built first (its outputs, stage and layers under
    "gguf"); then from each checkpoint at (T, P), record outputs, stage and weight bytes, and serve ENGINE_REQUESTS
    through the engine (rank 0 submits, the others follow); mode "engine" also runs the calls on Llama of extras(),
    the engine one step at a time and the staggered run."""
    import torch
    import torch.distributed as dist

    from llama import Llama

    torch.set_num_threads(1)
    T, P, out, mode, *paths = argv
    rank = int(os.environ["RANK"])
    dirs = [d for d in paths if not d.endswith(".gguf")]
    result = {"group_rank": int(os.environ.get("GROUP_RANK", 0)), "dirs": {}, "two": dirs[-1]}
    for path in [d for d in paths if d.endswith(".gguf")]:  # each rank dequantizes only its stage's tensors
        g = Llama.build(path, None, max_seq_len=64, max_batch_size=2, pipeline_parallel_size=int(P),
                        device="cpu", dtype="float32")
        result["gguf"] = {**gguf_outputs(g), "stage": g.model.stage.index, "layers": list(g.model.stage.layers)}
    stories_main(int(T), int(P), mode, dirs, rank, result)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def stories_main(T: int, P: int, mode: str, dirs, rank: int, result: dict) -> None:
    from llama import Llama
    from llama.distributed.pipeline import weight_bytes

    for d in dirs:
        g = Llama.build(d, str(STORIES / "tokenizer.model"), max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH,
                        model_parallel_size=T, pipeline_parallel_size=P, device="cpu", dtype="float32")
        stage = g.model.stage
        result["dirs"][d] = {**generations(g), "stage": stage.index, "layers": list(stage.layers),
                             "weight_bytes": weight_bytes(g.model), "embedding": g.model.tok_embeddings is not None,
                             "output": g.model.output is not None,
                             "cache_layers": len(g.cache.layers)}
    if mode == "engine":
        result["extras"] = extras(g)
        result["alone"] = alone(g)
        result["shared"] = shared_prefix(g, rank)
    # The engine: steps overlapping across the stages (the default), and (P=2 run) one step at a time
    for key, overlap in (("engine", None), ("one_step", False))[: 2 if mode == "engine" else 1]:
        engine = g.engine(overlap=overlap)
        if rank == 0:
            reqs = [engine.submit(p, **params) for p, params in ENGINE_REQUESTS]  # all in flight at once
            result[key] = [r.result(timeout=120) for r in reqs]
            result[f"{key}_stats"] = engine.stats
            engine.close()
        else:
            engine.serve_forever()
    if mode == "engine":
        result["unseeded"] = g.text_completion([ONCE], temperature=1.0, max_gen_len=20)  # RNG agrees after close
        result["staggered"] = staggered(str(STORIES), rank)


# ------------------------------------------------------------------------------------------------------ launching
def launch(tmp, args, T, P, out, mode, dirs, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "--no-python", sys.executable,
           "-c", SCRIPT, str(T), str(P), str(tmp / out), mode, *map(str, dirs)]
    return subprocess.Popen(cmd, cwd=tmp, env=rank_env(T * P, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(procs) -> None:
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)  # torchrun and its ranks
            _, err = p.communicate()
            pytest.fail(f"torchrun did not finish in {TIMEOUT} s:\n{err[-3000:]}")
        if p.returncode != 0:
            errors.append(error_lines(err))
    assert not errors, "\n\n".join(errors)


def outputs(tmp, out, world):
    return [json.loads((tmp / f"{out}.{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    if not (STORIES / "consolidated.00.pth").is_file() or not GOLDENS.is_file():
        pytest.skip(f"stories260K or its goldens not found under {STORIES.parent.parent}")
    from llama.hub.demo import random_state_dict
    from llama.formats.meta_checkpoint import save_checkpoint
    from llama.formats.reshard import reshard
    from llama.model import ModelArgs

    tmp = tmp_path_factory.mktemp("pipeline")
    reshard(STORIES, tmp / "two", 2)
    # Llama 3.2-style tied embeddings, 2 shards: stage 0 gets the table as its embedding, the last stage as its output
    params = {"dim": 64, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 512, "multiple_of": 32,
              "norm_eps": 1e-5}
    state = random_state_dict(ModelArgs.from_params(params), seed=3)
    del state["output.weight"]
    save_checkpoint(state, params, tmp / "tied", shards=2)
    return tmp, [STORIES, tmp / "two"], tmp / "tied"


@pytest.fixture(scope="module")
def single():
    """The single process's outputs and weight bytes: what every layout must reproduce."""
    from llama import Llama
    from llama.distributed.pipeline import weight_bytes

    g = build_stories(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
    out = {**generations(g), "extras": extras(g), "alone": alone(g), "weight_bytes": weight_bytes(g.model),
           "staggered": [g.text_completion([p], **params)[0] for p, params in STAGGERED + LATER]}
    out["unseeded"] = g.text_completion([ONCE], temperature=1.0, max_gen_len=20)
    off = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH,
                      prefix_cache="off")
    return {**out, "shared": [off.text_completion([p], **SHARED_OPTS)[0]["generation"] for p in SHARED_PROMPTS]}


@pytest.fixture(scope="module")
def p2(checkpoints):
    """torchrun --nproc_per_node 2 at T=1 x P=2: the GGUF file (dequantized: LLAMA_GGUF_BLOCKS=0, which only GGUF
    files read), then both checkpoints, the engine on the last build. One launch for every P=2 test here."""
    tmp, dirs, tied = checkpoints
    gguf = [GGUF] if GGUF.is_file() else []
    finish([launch(tmp, ["--standalone", "--nproc_per_node", "2"], 1, 2, "p2", "engine", [*gguf, tied, *dirs],
                   LLAMA_GGUF_BLOCKS="0")])
    return outputs(tmp, "p2", 2)


# Unseeded samples draw from the global RNG. On the CPU (mt19937) a call's draws follow one stream row after row, so
# the pipelined engine's groups (2 rows per call) draw what one process draws for 4 rows at once. CUDA's Philox
# gives each call offsets by its size, so there the groups draw other samples: equal across ranks, not to one
# process. Seeded samples (their own generator per row) are equal everywhere.
UNSEEDED_AS_ONE_PROCESS = not ON_CUDA


def check_ranks(ranks, single, goldens, T, P):
    total = single["weight_bytes"]
    for d in map(str, (STORIES, ranks[0]["two"])):
        per_rank = [r["dirs"][d] for r in ranks]
        for r in per_rank:
            assert r["greedy"] == [g["generated_tokens"] for g in goldens.values()], d
            assert r["sampled"] == (single["sampled"] if UNSEEDED_AS_ONE_PROCESS else per_rank[0]["sampled"]), d
            assert r["sampled"] != [g["generated_tokens"][:48] for g in goldens.values()]  # really sampled
            # resident weights: about 1/(T x P) of the model (stages are balanced to within one layer)
            assert 0.75 * total / (T * P) <= r["weight_bytes"] <= 1.25 * total / (T * P), (d, r["weight_bytes"], total)
        assert sum(r["weight_bytes"] for r in per_rank) <= 1.01 * total  # only norms are replicated
        # stage s = ranks s*T .. s*T+T-1; layers split contiguously; embedding first, output last; own cache layers
        assert [r["stage"] for r in per_rank] == [k // T for k in range(T * P)]
        layers = [per_rank[s * T]["layers"] for s in range(P)]
        assert sum(layers, []) == list(range(5)) and max(map(len, layers)) - min(map(len, layers)) <= 1
        assert [r["embedding"] for r in per_rank] == [r["stage"] == 0 for r in per_rank]
        assert [r["output"] for r in per_rank] == [r["stage"] == P - 1 for r in per_rank]
        assert [r["cache_layers"] for r in per_rank] == [len(r["layers"]) for r in per_rank]


# ------------------------------------------------------------------------------------------------------ tests
def test_two_stages_golden_and_seeded_samples_from_one_and_two_shards(p2, single, goldens):
    check_ranks(p2, single, goldens, 1, 2)


def test_two_stages_streams_sessions_failures_echo_prefixes_and_scores_match_one_process(p2, single):
    for r in p2:
        assert r["extras"]["mp"] == single["extras"]["mp"]
        assert r["extras"]["failed"] == single["extras"]["failed"]
        assert r["extras"]["failed"][0][0] is None and r["extras"]["failed"][2]  # the broken request alone failed
        got, want = r["extras"]["echo"][0], single["extras"]["echo"][0]
        assert got["tokens"] == want["tokens"] and got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
        assert r["extras"]["prefix"] == single["extras"]["prefix"]
        assert r["extras"]["score"] == pytest.approx(single["extras"]["score"], abs=1e-5)
        assert r["extras"]["long"] == single["extras"]["long"]
        assert r["extras"]["long_score"] == pytest.approx(single["extras"]["long_score"], abs=1e-4)


def test_two_stages_with_tied_embeddings_from_two_shards_match_one_process(p2, checkpoints):
    from llama import Llama

    tied = str(checkpoints[2])
    g = Llama.build(tied, str(STORIES / "tokenizer.model"), max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH)
    want = generations(g)
    if not UNSEEDED_AS_ONE_PROCESS:
        want["sampled"] = p2[0]["dirs"][tied]["sampled"]
    for r in p2:
        assert {k: r["dirs"][tied][k] for k in want} == want
    assert [r["dirs"][tied]["embedding"] for r in p2] == [True, False]
    assert [r["dirs"][tied]["output"] for r in p2] == [False, True]


def test_engine_under_two_stages_serves_concurrent_requests_as_each_alone(p2, single):
    r0, r1 = p2
    for key in ("engine", "one_step"):  # steps overlapping across the stages (the default), and one at a time
        assert r0[f"{key}_stats"]["peak_active"] == MAX_BATCH  # really concurrent: the slots were full at once
        assert r0[key] == r0["alone"] == single["alone"]
    assert r0["engine_stats"]["overlapped"] > 0 and "overlapped" not in r0["one_step_stats"]
    assert r1["alone"] == r0["alone"]
    # The last stage's RNG drew the unseeded samples and reached rank 0 with them; rank 0's reached every rank
    # when the engine closed: a later unseeded call still matches the single process.
    assert r1["unseeded"] == r0["unseeded"]
    assert r0["unseeded"] == single["unseeded"] or not UNSEEDED_AS_ONE_PROCESS


def test_two_stages_reuse_cached_prompt_blocks_and_give_the_cache_off_text(p2, single):
    r0, r1 = p2[0]["shared"], p2[1]["shared"]
    assert r0["calls"] == r1["calls"] == r0["served"] == single["shared"]
    assert min(r0["reused"]) >= 16 and r0["cached_tokens"] >= 16 * (len(SHARED_PROMPTS) - 1 + len(SHARED_PROMPTS))


def test_pipelined_engine_with_staggered_arrivals_a_cancellation_and_failures_matches_each_alone(p2, single):
    """Two groups of 2 slots (the second at cache rows 2-3) whose steps are in flight at once; requests arriving
    while others decode, one cancelled and two failing do not change any other request's output."""
    r0, r1 = p2[0]["staggered"], p2[1]["staggered"]
    assert r0["engine"] == r0["alone"] == r1["alone"] == single["staggered"]
    cancelled, failed, refused = r0["errors"]
    assert cancelled.startswith("CancelledError: request") and "was cancelled" in cancelled
    assert failed.startswith("ValueError: request") and "broken_after_3 raised RuntimeError('boom')" in failed
    assert refused.startswith("ValueError: prompt 0 has 301 tokens") and "max_seq_len=256" in refused
    assert (r0["slots"], r0["base"]) == (2, 2)
    stats = r0["stats"]
    assert stats["peak_active"] == 4 and stats["admitted"] == 8  # the refused request never reached a slot


def test_pipelined_engine_keeps_both_groups_in_flight_at_once(p2):
    """The structural proof of overlap: rank 0 launched one group's step (the first stage ran its layers and sent
    them on) before it finished the other group's step (before it took that step's logits back from the last
    stage), so the stages worked on different groups at the same time. No wall-clock timing involved."""
    r0 = p2[0]["staggered"]
    stats, trace = r0["stats"], [tuple(e) for e in r0["trace"]]
    assert stats["max_in_flight"] == 2
    assert stats["overlapped"] >= stats["launched"] // 2  # most steps were launched with the other group in flight
    assert trace[:3] == [("launch", 0, 1), ("launch", 1, 2), ("finish", 0, 1)]
    # from then on the groups alternate: each group's step is launched right after the other group's finished
    for (e1, g1, t1), (e2, g2, t2) in zip(trace[2:20:2], trace[3:21:2]):
        assert (e1, e2) == ("finish", "launch") and g1 == g2 and t2 > t1


def test_two_stages_from_a_gguf_file_match_one_process(p2, monkeypatch):
    """With LLAMA_GGUF_BLOCKS=0 (the GPU's path), each rank dequantizes only its stage's tensors of a Q4_1 GGUF file
    (tied embeddings: the table is the first stage's embedding and the last stage's output) and the greedy text is
    the single process's, dequantized too (stages in the file's blocks: tests/distributed/test_gguf_stages.py)."""
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} not found")
    from llama import Llama

    monkeypatch.setenv("LLAMA_GGUF_BLOCKS", "0")  # as p2's ranks ran
    want = gguf_outputs(Llama.build(str(GGUF), None, max_seq_len=64, max_batch_size=2, dtype="float32"))
    ranks = [r["gguf"] for r in p2]
    assert [r["greedy"] for r in ranks] == [want["greedy"]] * 2
    assert [r["stage"] for r in ranks] == [0, 1] and [r["layers"] for r in ranks] == [list(range(15)),
                                                                                      list(range(15, 30))]
    for r in ranks:  # about half the weights each (the 28M-parameter table is on both, once as each role)
        assert 0.5 * want["weight_bytes"] <= r["weight_bytes"] <= 0.75 * want["weight_bytes"], r["weight_bytes"]


def test_bad_layouts_raise_clear_errors(checkpoints):
    from llama import Llama
    from llama.distributed.pipeline import check_layout, micro_batches, split_layers
    from llama.model import ModelArgs

    with pytest.raises(ValueError, match=r"pipeline_parallel_size 6 exceeds n_layers \(5\).*at most 5 stages"):
        split_layers(5, 6)
    args = ModelArgs(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512)
    with pytest.raises(ValueError, match=r"model parallel size 3 does not divide n_heads \(8\)"):
        check_layout(args, 3, 2)
    with pytest.raises(ValueError, match=r"model parallel size 8 does not divide n_kv_heads \(4\)"):
        check_layout(args, 8, 1)
    assert [list(r) for r in split_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    assert micro_batches(1, 2) == [(0, 1)] and micro_batches(100, 2) == [(0, 100)]  # decode, short prefill: whole
    assert micro_batches(209, 2) == [(0, 69), (69, 139), (139, 209)]
    assert micro_batches(1024, 2) == [(0, 256), (256, 512), (512, 768), (768, 1024)]  # up to 2 x P chunks
    assert [len(r) for r in split_layers(126, 4)] == [32, 32, 31, 31]
    tok = str(STORIES / "tokenizer.model")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 2 does not divide the world size 1"):
        Llama.build(str(STORIES), tok, max_seq_len=32, max_batch_size=1, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"model_parallel_size \(2\) x pipeline_parallel_size \(2\) must equal the "
                                         r"world size 1"):
        Llama.build(str(STORIES), tok, max_seq_len=32, max_batch_size=1, model_parallel_size=2,
                    pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be a positive integer, got 0"):
        Llama.build(str(STORIES), tok, max_seq_len=32, max_batch_size=1, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match=r"compile=True is not available with pipeline_parallel_size=2"):
        Llama.build(str(STORIES), tok, max_seq_len=32, max_batch_size=1, pipeline_parallel_size=2, compile=True)


def test_pipeline_execution_routes_logits_by_who_samples():
    """Calls on Llama: sampling passes keep their logits on the last stage, which shares the samples; under the
    engine (leader_samples) they go to rank 0 on the first stage, which samples alone, deferred while steps overlap.
    Passes whose logits everyone reads always broadcast them. The core's default runs one stage."""
    from types import SimpleNamespace

    from llama.core.worker.runner import Execution
    from llama.distributed.pipeline import Outbox, Pending, PipelineExecution, Stage

    shared = []
    model = SimpleNamespace(stage=Stage(0, 2, range(0, 1), (0, 1)), outbox=Outbox(),
                            share_samples=lambda draw: shared.append(draw()) or ("shared",))
    ex = PipelineExecution(model)
    assert ex.lockstep == (None, 0) and ex.outbox is model.outbox
    assert ex.route(sampling=True) == {"logits_to": "last", "deferred": False}
    assert ex.route(sampling=False) == {"logits_to": "all", "deferred": False}
    assert ex.share(lambda: ("drawn",)) == ("shared",) and shared == [("drawn",)]
    with ex.leader_samples(deferred=True):
        assert ex.route(sampling=True) == {"logits_to": "first", "deferred": True}
        assert ex.route(sampling=False) == {"logits_to": "all", "deferred": True}
        assert ex.share(lambda: ("drawn",)) == ("drawn",) and len(shared) == 1
    assert ex.route(sampling=True) == {"logits_to": "last", "deferred": False}
    assert ex.resolve([Pending(lambda: 3), None, 4]) == [3, None, 4]

    local = Execution()
    assert local.route(sampling=True) == {} and local.share(lambda: ("drawn",)) == ("drawn",)
    assert local.lockstep is None and local.overlap(None, 8) is None
