"""GGUF block weights under torchrun (gloo): pipeline stages (P=2) of the shared SmolLM2 Q4_1 file and of a small
random K-quant file; model parallel (T=2) over an FFN of 5 super-blocks, which splits 3 | 2 on block boundaries
(llama/formats/gguf_quants.py, ffn_bounds), and over 12 attention heads of 64 whose even split would cut wo's
super-blocks, which split 8 | 4 on key/value-group boundaries (llama/formats/gguf_heads.py); and both at once
(T=2 x P=2, 4 ranks). Every rank keeps its tensors in their own blocks, and the greedy ids and logits are the single
process's: bitwise for stages (the same products on the same rows), to fp32 rounding for model parallel (the
row-parallel partial sums are added in another order)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import hardware
import pytest
import torch
from conftest import SHARED, STORIES, need, rank_env
from gguf_blocks_data import Q4_K_M, write_block_gguf


pytestmark = hardware.KERNELS

TESTS = Path(__file__).resolve().parent
Q4_1 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# FFN 1280 = 5 super-blocks of 256: no even split over 2 ranks; attention 512 = 2 per rank
PARAMS = {"dim": 512, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "hidden_dim": 1280, "norm_eps": 1e-5,
          "vocab_size": 512}
# 12 heads of 64 in 6 key/value groups: wo's 768 inputs are 3 super-blocks, so 6 heads a rank would cut one
HEADS = {**PARAMS, "dim": 768, "n_heads": 12, "n_kv_heads": 6}
PROMPTS = [[1, 20, 30, 40], [1, 99, 7]]
SEQ = list(range(1, 80, 3))

SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
sys.path[:0] = {tests!r}
from test_gguf_stages import outputs
torch.set_num_threads(1)
T, P, out, *paths = sys.argv[1:]
res = {{p: outputs(p, model_parallel_size=int(T), pipeline_parallel_size=int(P)) for p in paths}}
json.dump(res, open(f"{{out}}.{{dist.get_rank()}}.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def outputs(path, **kw) -> dict:
    """Greedy ids of a batch of two prompts, teacher-forced logits of SEQ, and what this rank holds as blocks."""
    from llama import Llama
    from llama.formats import gguf_quants
    from llama.quantization import gguf_blocks

    g = Llama.build(str(path), None, max_seq_len=128, max_batch_size=2, device="cpu", compile=False, **kw)
    ids = g.generate(PROMPTS, max_gen_len=12, temperature=0)[0]
    with g.cache.hold():
        logits = g.runner.logits([SEQ])[0]
    w2_inputs, w13_rows, heads = [], [], []
    for layer in g.model.layers:
        ff, at = layer.feed_forward, layer.attention
        if isinstance(ff.w2.method, gguf_blocks.GGUFBlocks):
            w2_inputs.append(gguf_blocks.values_per_row(ff.w2.method.qtype, ff.w2.weight.shape[1]))
            w13_rows.append((ff.w13 or ff.w1).weight.shape[0])
        wo_inputs = gguf_blocks.values_per_row(at.wo.method.qtype, at.wo.weight.shape[1])
        heads.append([at.n_local_heads, at.n_local_kv_heads, wo_inputs, at.local_sizes["wv"]])
    return {"ids": ids, "logits": logits.tolist(), "kinds": gguf_quants.summary(g.model),
            "embedding": type(g.model.tok_embeddings).__name__, "w2_inputs": w2_inputs, "w13_rows": w13_rows,
            "heads": heads}


def launch(tmp_path, T: int, P: int, name: str, paths) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT.format(tests=[str(TESTS), str(TESTS.parent)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(T * P), str(script),
           str(T), str(P), str(tmp_path / name), *map(str, paths)]
    return subprocess.Popen(cmd, env=rank_env(T * P), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def ranks(proc, tmp_path, name, world: int = 2) -> list:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"{name}.{r}.json").read_text()) for r in range(world)]


@pytest.fixture
def procs():
    """Launched jobs, killed (torchrun and its ranks) if the test ends before they do."""
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


@pytest.fixture(scope="module")
def kquant(tmp_path_factory):
    return write_block_gguf(tmp_path_factory.mktemp("stages") / "kquant.gguf", PARAMS,
                            need(STORIES / "tokenizer.model"), lambda n: Q4_K_M.get(n, "Q4_K"))


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    return write_block_gguf(tmp_path_factory.mktemp("heads") / "heads.gguf", HEADS,
                            need(STORIES / "tokenizer.model"), lambda n: Q4_K_M.get(n, "Q4_K"))


def close_to(r, one, flips: bool = False):
    """Model parallel's greedy ids and logits are the one process's, logits to fp32 rounding: the row-parallel
    partial sums are added in another order. That difference (1e-7) can round one int8 activation code of a later
    product the other way, which moves that position's logits by up to 1e-2 of their range; with `flips`, a third
    of the positions may differ by that much (a wrong split moves every position by the logits' own size)."""
    assert r["ids"] == one["ids"]
    ours, ref = torch.tensor(r["logits"]), torch.tensor(one["logits"])
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    err, scale = (ours - ref).abs().amax(-1), ref.abs().max()
    if not flips:
        assert err.max() <= 1e-5 * scale, err.max()
        return
    assert err.max() <= 1e-2 * scale and (err <= 1e-5 * scale).float().mean() >= 2 / 3, err


def test_stages_and_uneven_model_parallel_keep_their_blocks_and_give_one_process_output(kquant, heads, tmp_path,
                                                                                        procs):
    smol = need(Q4_1)
    staged = launch(tmp_path, 1, 2, "pp", [smol, kquant])
    split = launch(tmp_path, 2, 1, "mp", [kquant, heads])
    both = launch(tmp_path, 2, 2, "tp", [heads])
    procs += [staged, split, both]
    want = {p: outputs(p) for p in (smol, kquant, heads)}  # meanwhile: one process, blocks too
    assert want[smol]["kinds"] == {"Q4_1": 120, "Q8_0": 1} and want[kquant]["kinds"] == {"Q4_K": 8, "Q6_K": 5}
    assert want[heads]["heads"] == [[12, 6, 768, 384]] * 2

    stages = ranks(staged, tmp_path, "pp")
    for path in (smol, kquant):
        one = want[path]
        first, last = (r[str(path)] for r in stages)
        for r in (first, last):
            assert r["ids"] == one["ids"] and torch.equal(torch.tensor(r["logits"]), torch.tensor(one["logits"]))
        # each stage holds its own layers' blocks (the output on the last), and the first the block embedding
        assert first["kinds"] and last["kinds"] and all(first["kinds"].values()) and all(last["kinds"].values())
        total = {k: first["kinds"].get(k, 0) + last["kinds"].get(k, 0) for k in one["kinds"]}
        assert total == one["kinds"] and first["embedding"] == "BlockEmbedding" and last["embedding"] == "NoneType"

    # per rank of T=2: (local heads, local kv heads, wo inputs, wv rows); 6 heads a rank would cut wo's blocks
    split_heads = [[8, 4, 512, 256], [4, 2, 256, 128]]
    for rank, r in enumerate(ranks(split, tmp_path, "mp")):
        mine = r[str(kquant)]
        assert mine["kinds"] == want[kquant]["kinds"]
        assert mine["w2_inputs"] == [[768, 512][rank]] * 2 and mine["w13_rows"] == [2 * [768, 512][rank]] * 2, mine
        close_to(mine, want[kquant])
        mine = r[str(heads)]
        assert mine["kinds"] == want[heads]["kinds"] and mine["heads"] == [split_heads[rank]] * 2, mine["heads"]
        close_to(mine, want[heads], flips=True)
        mp_heads = mine

    # T=2 x P=2: each stage's layer split as above, every rank with T=2's output bit for bit (stages add nothing)
    tp = [r[str(heads)] for r in ranks(both, tmp_path, "tp", world=4)]
    for r in tp:
        assert r["ids"] == mp_heads["ids"] and r["logits"] == mp_heads["logits"]
        assert len(r["heads"]) == 1 and r["heads"][0] in split_heads, r["heads"]
    assert sorted(r["heads"][0] for r in tp) == sorted(split_heads * 2)
    assert {k: sum(r["kinds"].get(k, 0) for r in tp) for k in want[heads]["kinds"]} == {
        k: 2 * v for k, v in want[heads]["kinds"].items()}  # each stage's layers once per tensor-parallel rank


@pytest.fixture(autouse=True)
def own_arithmetic(monkeypatch):
    """Stages and model-parallel ranks run our own arithmetic between the products (llama.cpp's, the one-process
    default for a GGUF model in its blocks, is not applied to stages): the one process they are compared with too."""
    from llama import settings

    monkeypatch.setenv("LLAMA_GGML_ARITH", "0")
    settings.reload()
    yield
    monkeypatch.undo()
    settings.reload()
