"""Prefix caching under model parallel (torchrun, 2 ranks, gloo): rank 0 plans with its block pool and the other
rank applies the same block tables from the broadcast ops, so Llama calls and the engine reuse cached prompt blocks
on both ranks and give the text of a single process with the cache off; in a pool too small for its requests rank
0 grows and preempts, and the other rank follows the block tables; after the engine stops, the other rank's pool
is rank 0's, so later lockstep calls plan the same cache hits."""

import textwrap

from conftest import STORIES
from helpers import two_rank_stories

SYSTEM = ("You are a storyteller who tells short, happy stories about animals in a park, with a cat, a dog and a "
          "little bird who are friends.")
PROMPTS = [SYSTEM + " Tell me about the cat.", SYSTEM + " Tell me about the dog.", SYSTEM + " And the bird?"]
GREEDY = dict(temperature=0.0, max_gen_len=20)

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from llama.generation import Llama

    ckpt, tokenizer, out, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    MORE = ["Once upon a time", "Lily and Ben went to the park", "The little dog"]
    llama = Llama.build(ckpt, tokenizer, max_seq_len=256, max_batch_size=4, device="cpu", dtype="float32")
    opts = dict(temperature=0.0, max_gen_len=20)
    calls = [llama.text_completion([p], **opts)[0]["generation"] for p in prompts]  # each after the last: hits
    hits_calls = llama.cache.pool.stats["cached_tokens"]
    engine = llama.engine()
    if os.environ["RANK"] == "0":
        reqs = [engine.submit(p, **opts) for p in prompts]
        served = [r.result()["generation"] for r in reqs]
        reused = [r.reused for r in reqs]
        engine.close()
    else:
        engine.serve_forever()
    # prompts only the engine has seen: afterwards every rank's pool must plan what rank 0's does
    new = [p + " Again, please." for p in prompts]
    engine = llama.engine()
    if os.environ["RANK"] == "0":
        reqs = [engine.submit(p, **opts) for p in new]
        served_new = [r.result()["generation"] for r in reqs]
        engine.close()
    else:
        engine.serve_forever()
    pool = llama.cache.pool
    pools = [None, None]
    dist.all_gather_object(pools, [pool.available(), pool.cached(), [len(pool.lookup(
        llama.tokenizer.encode(p, bos=True, eos=False))) for p in new]])
    again, hits_again = None, 0
    if pools[0] == pools[1]:  # out of step, a lockstep call would hang
        before = pool.stats["cached_tokens"]
        again = [llama.text_completion([p], **opts)[0]["generation"] for p in new]
        hits_again = pool.stats["cached_tokens"] - before
    # a pool of 10 blocks (one 128-position sequence takes 8), too small for these requests: growth, preemption
    tight = Llama.build(ckpt, tokenizer, max_seq_len=128, max_batch_size=4, device="cpu", dtype="float32",
                        kv_cache_memory=10 * (llama.cache.bytes // llama.cache.num_blocks))
    engine = tight.engine(prefill_chunk=16)
    if os.environ["RANK"] == "0":
        reqs = [engine.submit(p, temperature=0.0, max_gen_len=60) for p in prompts + MORE]
        dry = [r.result()["generation"] for r in reqs]
        engine.close()
        json.dump({"calls": calls, "served": served, "reused": reused, "hits_calls": hits_calls, "dry": dry,
                   "pools": pools, "served_new": served_new, "again": again, "hits_again": hits_again,
                   "preemptions": tight.cache.pool.stats["preemptions"]}, open(out, "w"))
    else:
        engine.serve_forever()
    dist.barrier()
    dist.destroy_process_group()
""")


def test_model_parallel_reuses_the_cache_with_the_cache_off_text(tmp_path):
    from llama import Llama

    got = two_rank_stories(tmp_path, SCRIPT, PROMPTS)
    ref = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=256, max_batch_size=4,
                      device="cpu", dtype="float32", prefix_cache="off")
    want = [r["generation"] for r in ref.text_completion(PROMPTS, **GREEDY)]
    assert got["calls"] == want and got["served"] == want
    assert got["hits_calls"] >= 2 * 32 and all(n >= 32 for n in got["reused"])
    # after the engine, the follower's pool is rank 0's: the same cache hits, so a lockstep call agrees and reuses
    # what the engine cached
    assert got["pools"][0] == got["pools"][1] and min(got["pools"][0][2]) >= 2
    assert got["again"] == got["served_new"] and got["hits_again"] >= 3 * 32
    # a dry pool: rank 0 grows and preempts, rank 1 replays the block tables; the roomy single process's text
    more = ["Once upon a time", "Lily and Ben went to the park", "The little dog"]
    roomy = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=128, max_batch_size=4,
                        device="cpu", dtype="float32", prefix_cache="off")
    assert got["dry"] == [r["generation"] for r in roomy.text_completion(PROMPTS + more, temperature=0.0,
                                                                         max_gen_len=60)]
    assert got["preemptions"] > 0
