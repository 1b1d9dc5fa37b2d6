"""GGUF block weights under torchrun (gloo, 2 ranks): pipeline stages (P=2) of the shared SmolLM2 Q4_1 file and of a
small random K-quant file, and model parallel (T=2) over an FFN of 5 super-blocks, which splits 3 | 2 on block
boundaries (llama/formats/gguf_quants.py, ffn_bounds). Every rank keeps its tensors in their own blocks, and the
greedy ids and logits are the single process's: bitwise for stages (the same products on the same rows), to fp32
rounding for model parallel (the row-parallel partial sums are added in another order)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SHARED, STORIES, need, rank_env
from gguf_blocks_data import Q4_K_M, write_block_gguf

from llama.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels are not built here")

TESTS = Path(__file__).resolve().parent
Q4_1 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# FFN 1280 = 5 super-blocks of 256: no even split over 2 ranks; attention 512 = 2 per rank
PARAMS = {"dim": 512, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "hidden_dim": 1280, "norm_eps": 1e-5,
          "vocab_size": 512}
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
    w2_inputs, w13_rows = [], []
    for layer in g.model.layers:
        ff = layer.feed_forward
        if isinstance(ff.w2.method, gguf_blocks.GGUFBlocks):
            w2_inputs.append(gguf_blocks.values_per_row(ff.w2.method.qtype, ff.w2.weight.shape[1]))
            w13_rows.append((ff.w13 or ff.w1).weight.shape[0])
    return {"ids": ids, "logits": logits.tolist(), "kinds": gguf_quants.summary(g.model),
            "embedding": type(g.model.tok_embeddings).__name__, "w2_inputs": w2_inputs, "w13_rows": w13_rows}


def launch(tmp_path, T: int, P: int, name: str, paths) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT.format(tests=[str(TESTS), str(TESTS.parent)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(T), str(P), str(tmp_path / name), *map(str, paths)]
    return subprocess.Popen(cmd, env=rank_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def ranks(proc, tmp_path, name) -> list:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"{name}.{r}.json").read_text()) for r in range(2)]


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


def test_stages_and_uneven_model_parallel_keep_their_blocks_and_give_one_process_output(kquant, tmp_path, procs):
    smol = need(Q4_1)
    staged = launch(tmp_path, 1, 2, "pp", [smol, kquant])
    split = launch(tmp_path, 2, 1, "mp", [kquant])
    procs += [staged, split]
    want = {p: outputs(p) for p in (smol, kquant)}  # meanwhile: one process, blocks too
    assert want[smol]["kinds"] == {"Q4_1": 120, "Q8_0": 1} and want[kquant]["kinds"] == {"Q4_K": 8, "Q6_K": 5}

    stages = ranks(staged, tmp_path, "pp")
    for path, one in want.items():
        first, last = (r[str(path)] for r in stages)
        for r in (first, last):
            assert r["ids"] == one["ids"] and torch.equal(torch.tensor(r["logits"]), torch.tensor(one["logits"]))
        # each stage holds its own layers' blocks (the output on the last), and the first the block embedding
        assert first["kinds"] and last["kinds"] and all(first["kinds"].values()) and all(last["kinds"].values())
        total = {k: first["kinds"].get(k, 0) + last["kinds"].get(k, 0) for k in one["kinds"]}
        assert total == one["kinds"] and first["embedding"] == "BlockEmbedding" and last["embedding"] == "NoneType"

    one = want[kquant]
    for rank, r in enumerate(ranks(split, tmp_path, "mp")):
        r = r[str(kquant)]
        assert r["kinds"] == one["kinds"]
        assert r["w2_inputs"] == [[768, 512][rank]] * 2 and r["w13_rows"] == [2 * [768, 512][rank]] * 2, r
        assert r["ids"] == one["ids"]
        ours, ref = torch.tensor(r["logits"]), torch.tensor(one["logits"])
        assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max(), (ours - ref).abs().max()
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
