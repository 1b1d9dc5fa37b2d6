"""Model parallel under torchrun on CPU (gloo): golden greedy ids at MP=2 from 1 and 2 shards, sampling identical to
MP=1, a two-node rendezvous on 127.0.0.1, a clear error at an impossible size, and refusal of bad checkpoints."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import GOLDENS, STORIES, rank_env
from helpers import ONCE
from serve_util import free_port

from llama.formats.reshard import reshard

TIMEOUT = 300

# Run by every rank: build from each checkpoint, sample then decode greedily, write this rank's tokens; with "mp",
# also mp_outputs() of the first checkpoint's build (seeded, streamed, stopped and chat texts).
SCRIPT = textwrap.dedent(f"""
    import json, os, sys
    import torch.distributed as dist
    from llama.generation import Llama
    sys.path[:0] = [{str(Path(__file__).resolve().parent)!r}, {str(Path(__file__).resolve().parents[1])!r}]
    from test_tensor_parallel import mp_outputs

    goldens, tokenizer, out, mp, *dirs = sys.argv[1:]
    prompts = [g["prompt_tokens"] for g in json.load(open(goldens)).values()]
    result = {{}}
    for d in dirs:
        llama = Llama.build(d, tokenizer, max_seq_len=160, max_batch_size=2, device="cpu", dtype="float32")
        sampled, _ = llama.generate(prompts, max_gen_len=48, temperature=0.8, top_p=0.9)  # first: seed just set
        greedy, _ = llama.generate(prompts, max_gen_len=128, temperature=0.0)
        result[d] = {{"greedy": greedy, "sampled": sampled}}
        if mp == "mp" and d == dirs[0]:
            result[d]["mp"] = mp_outputs(llama)
            llama.runner.run_ahead = True  # asynchronous decode (the CUDA default) forced on: ranks queue alike
            ahead = {{"greedy": llama.generate(prompts, max_gen_len=128, temperature=0.0)[0],
                     "mp": mp_outputs(llama)}}
            result[d]["ahead"] = {{**ahead, "stats": llama.runner.ahead_stats}}
    with open(f"{{out}}.{{os.environ['RANK']}}.json", "w") as f:
        json.dump({{"world_size": int(os.environ["WORLD_SIZE"]), "result": result}}, f)
    dist.barrier()
    dist.destroy_process_group()  # a clean exit, so the other node's rendezvous is not left hanging
""")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not (STORIES / "consolidated.00.pth").is_file() or not GOLDENS.is_file():
        pytest.skip(f"shared stories260K model or goldens not found under {STORIES.parent.parent} (expected <repo root>/../shared)")
    tmp = tmp_path_factory.mktemp("dist")
    reshard(STORIES, tmp / "two", 2)
    (tmp / "run.py").write_text(SCRIPT)
    goldens = json.loads(GOLDENS.read_text())
    return tmp, goldens


def torchrun(tmp, *launch_args, out, dirs, mp=False):
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch_args, str(tmp / "run.py"), str(GOLDENS),
           str(STORIES / "tokenizer.model"), str(tmp / out), "mp" if mp else "-", *map(str, dirs)]
    env = rank_env(3)
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc):
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def rank_outputs(tmp, out, world):
    results = [json.loads((tmp / f"{out}.{r}.json").read_text()) for r in range(world)]
    assert all(r["world_size"] == world for r in results)
    return [r["result"] for r in results]


@pytest.fixture(scope="module")
def two_procs(setup):
    """One `torchrun --nproc_per_node 2` launch loading the 1-shard and the 2-shard checkpoint (and mp_outputs() of
    the 1-shard build)."""
    tmp, goldens = setup
    rc, out, err = finish(torchrun(tmp, "--standalone", "--nproc_per_node", "2", out="mp2",
                                   dirs=[STORIES, tmp / "two"], mp=True))
    assert rc == 0, err[-3000:]
    return tmp, goldens, rank_outputs(tmp, "mp2", 2), out


def test_torchrun_two_processes_golden_from_one_and_two_shards(two_procs):
    tmp, goldens, ranks, _ = two_procs
    assert ranks[0] == ranks[1], "ranks diverged"
    for d in (str(STORIES), str(tmp / "two")):
        for got, g in zip(ranks[0][d]["greedy"], goldens.values()):
            assert got == g["generated_tokens"], d


def test_only_rank_0_prints(two_procs):
    *_, stdout = two_procs
    assert stdout.count("Loaded in") == 2  # two builds, printed by rank 0 alone


@pytest.fixture(scope="module")
def mp1(setup):
    """What one process gives for the calls each rank of two_procs made on its first build, in the same order."""
    from llama.generation import Llama

    _, goldens = setup
    prompts = [g["prompt_tokens"] for g in goldens.values()]
    llama = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=160, max_batch_size=2,
                        device="cpu", dtype="float32")
    sampled, _ = llama.generate(prompts, max_gen_len=48, temperature=0.8, top_p=0.9)
    llama.generate(prompts, max_gen_len=128, temperature=0.0)
    return {"sampled": sampled, "mp": mp_outputs(llama)}


def test_sampling_at_mp2_matches_mp1_with_the_same_seed(two_procs, mp1):
    tmp, goldens, ranks, _ = two_procs
    sampled = mp1["sampled"]
    greedy48 = [g["generated_tokens"][:48] for g in goldens.values()]
    assert sampled != greedy48 and all(len(s) > 0 for s in sampled)  # really sampled, not greedy
    assert ranks[0][str(STORIES)]["sampled"] == sampled
    assert ranks[0][str(tmp / "two")]["sampled"] == sampled


def test_two_nodes_over_a_127_0_0_1_rendezvous(setup):
    tmp, goldens = setup
    port = free_port()
    nodes = [
        torchrun(tmp, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank), "--rdzv_backend", "c10d",
                 "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "llama-test", out="nodes", dirs=[tmp / "two"])
        for rank in (0, 1)
    ]
    finished = [finish(p) for p in nodes]
    for rc, _, err in finished:
        assert rc == 0, err[-3000:]
    ranks = rank_outputs(tmp, "nodes", 2)
    assert ranks[0] == ranks[1]
    assert ranks[0][str(tmp / "two")]["greedy"] == [g["generated_tokens"] for g in goldens.values()]


def test_three_ranks_on_8_heads_4_kv_heads_fail_clearly(setup):
    tmp, _ = setup
    rc, _, err = finish(torchrun(tmp, "--standalone", "--nproc_per_node", "3", out="mp3", dirs=[STORIES]))
    assert rc != 0
    assert "ValueError: model parallel size 3 does not divide n_heads (8)" in err
    assert not list(tmp.glob("mp3.*.json"))


def test_checklist_mismatch_is_refused(setup, tmp_path):
    from llama.generation import Llama

    d = tmp_path / "model"
    shutil.copytree(STORIES, d, ignore=shutil.ignore_patterns("llama2c"))
    data = bytearray((d / "consolidated.00.pth").read_bytes())
    data[-5000] ^= 0x40
    (d / "consolidated.00.pth").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"checksum mismatch .*consolidated\.00\.pth"):
        Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=32, max_batch_size=1, device="cpu", verify=True)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_carrying_code_is_refused(setup, tmp_path):
    from llama.generation import Llama

    d = tmp_path / "model"
    d.mkdir()
    for name in ("params.json", "tokenizer.model"):
        shutil.copy(STORIES / name, d / name)
    state = torch.load(STORIES / "consolidated.00.pth", weights_only=True)
    state["rope.freqs"] = _RunsCode(str(tmp_path / "pwned"))
    torch.save(state, d / "consolidated.00.pth")
    with pytest.raises(ValueError, match=r"refusing to load .*consolidated\.00\.pth: it pickles objects other than"):
        Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=32, max_batch_size=1, device="cpu")
    assert not (tmp_path / "pwned").exists()


# --------------------------------------------------------------------------------------------- model parallel
def mp_outputs(g):
    """Seeded, streamed, stopped and chat outputs: what must not change with the model-parallel size."""
    kw = dict(temperature=1.0, top_p=1.0, max_gen_len=40)
    res = [r["generation"] for r in g.text_completion([ONCE, "Lily"], seed=[7, 8], **kw)]
    res.append("".join(g.stream_completion(ONCE, seed=7, stop=[" loved"], **kw)))
    session = g.chat_session()
    return res + [session.send("Hi", temperature=0, max_gen_len=10), session.send("More", seed=3, **kw)]


def test_seeded_outputs_identical_at_mp2(two_procs, mp1):
    """Two model-parallel ranks (torchrun, gloo on CPU) give the same texts as one process, with decode steps
    queued ahead too (llama/core/worker/ahead.py: each rank draws the same tokens and queues the same step)."""
    *_, ranks, _ = two_procs
    assert ranks[0][str(STORIES)]["mp"] == ranks[1][str(STORIES)]["mp"] == mp1["mp"]
    goldens = [g["generated_tokens"] for g in two_procs[1].values()]
    for r in ranks:
        ahead = r[str(STORIES)]["ahead"]
        assert ahead["greedy"] == goldens and ahead["mp"] == mp1["mp"]
        assert ahead["stats"]["used"] > 100 and ahead["stats"] == ranks[0][str(STORIES)]["ahead"]["stats"]
    mp1 = mp1["mp"]
    assert " loved" in mp1[0], "the stop string must occur in the unstopped text for the stop check to mean anything"
    assert mp1[2] == mp1[0][: mp1[0].find(" loved")] and mp1[0] != mp1[1]
