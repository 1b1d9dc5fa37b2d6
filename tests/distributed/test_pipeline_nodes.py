"""Pipeline parallel at T=2 x P=2 as a simulated two-node job (two torchrun launches of 2 processes each, c10d
rendezvous on 127.0.0.1): the stories260K goldens and the single process's seeded samples from 1- and 2-shard
checkpoints, each rank holding about 1/4 of the weights, tensor parallel within a node, and the pipelined engine.
(P=2 alone: test_pipeline.py, whose rank script this job runs; a file of its own, so that two pytest workers share
the launches.)"""

import pytest
from conftest import GOLDENS, STORIES
from helpers import build_stories
from serve_util import free_port
from test_pipeline import MAX_BATCH, MAX_SEQ_LEN, alone, check_ranks, finish, generations, launch, outputs


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two torchrun launches of 2 processes each, on stories260K from 1 and 2 shards."""
    if not (STORIES / "consolidated.00.pth").is_file() or not GOLDENS.is_file():
        pytest.skip(f"stories260K or its goldens not found under {STORIES.parent.parent}")
    from llama.formats.reshard import reshard

    tmp = tmp_path_factory.mktemp("pipeline_nodes")
    reshard(STORIES, tmp / "two", 2)
    port = free_port()
    finish([launch(tmp, ["--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(node), "--rdzv_backend", "c10d",
                         "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "llama-pp-test"], 2, 2, "nodes", "plain",
                   [STORIES, tmp / "two"]) for node in (0, 1)])
    return outputs(tmp, "nodes", 4)


@pytest.fixture(scope="module")
def single():
    """The single process's outputs and weight bytes that check_ranks and the engine's check compare with."""
    from llama.distributed.pipeline import weight_bytes

    g = build_stories(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ_LEN)
    return {**generations(g), "alone": alone(g), "weight_bytes": weight_bytes(g.model)}


def test_tp2_x_pp2_on_two_simulated_nodes(two_nodes, single, goldens):
    check_ranks(two_nodes, single, goldens, 2, 2)
    # the pipelined engine with 2 tensor-parallel ranks per stage (rank 1 follows rank 0's finish messages)
    assert two_nodes[0]["engine"] == single["alone"] and two_nodes[0]["engine_stats"]["overlapped"] > 0
    for rank, r in enumerate(two_nodes):  # each node (c10d group rank) holds one whole stage: TP stays on the node
        assert r["group_rank"] == rank // 2 == next(iter(r["dirs"].values()))["stage"]
