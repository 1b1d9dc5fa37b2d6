"""The pipelined engine's groups (llama/distributed/pipeline_engine.py) share one block pool: a request that can
never fit beside the live prefixes holding it fails with the decode core's clear ValueError instead of waiting
forever, and the groups go on serving. Run in one process (the groups need no second stage to plan)."""

import pytest
from conftest import STORIES, need

from llama.distributed.pipeline import Outbox
from llama.distributed.pipeline_engine import Pipelined


def test_pipelined_groups_fail_a_request_that_never_fits_beside_prefixes():
    from llama import Llama

    d = str(need(STORIES))
    llm = Llama.build(d, d + "/tokenizer.model", max_seq_len=256, max_batch_size=4)
    pipe = Pipelined(llm.core, 64, 2, Outbox())

    def serve(prompt):
        req = llm.inputs.samples(prompt, dict(temperature=0.0, max_gen_len=4), None, 1)[0]
        pipe.assign([req])
        with llm.cache.hold(), llm.runner.leader_samples(deferred=True):
            for _ in range(40):
                if not pipe.has_work():
                    break
                pipe.turn()
        assert not pipe.has_work(), "the request still waits"
        return req

    prefixes = [llm.prefill([1] + [300 + i] * 250) for i in range(4)]  # 4 x 16 blocks: the whole pool
    try:
        req = serve("Hello")
        assert isinstance(req.error, ValueError)
        with pytest.raises(ValueError, match="needs 1 KV blocks and the pool has 0 of 64 available; live prefixes "
                                             "and chat sessions hold 64"):
            req.result(timeout=1)
        prefixes[3].close()
        assert serve("Hello").result(timeout=1)["generation"] == llm.text_completion(
            ["Hello"], temperature=0.0, max_gen_len=4)[0]["generation"]  # it fits now
    finally:
        for p in prefixes:
            p.close()
