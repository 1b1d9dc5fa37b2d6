"""prefix_cache="exact" grows its blocks with use, keys the blocks its decode steps wrote, and preempts like "on"
(llama/core/scheduling/paging.py): a decode step's row is bitwise a prefill's under its row-invariant arithmetic, so a reply's
cached positions and a preempted request's recomputed ones hold what decoding wrote. Tokens and every logprob are
bitwise a roomy pool's, in fp32 and bf16, and a cached reply is reused by the next turn with a cold cache's
logprobs."""

import pytest
from conftest import STORIES, need

PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog", "Tom had a red ball",
           "One day, a cat", "The sun was hot"]
GREEDY = dict(temperature=0.0, max_gen_len=60, logprobs=True)
SEEDED = dict(temperature=0.9, top_p=0.95, seed=7, max_gen_len=60, logprobs=True, n=2, stop=["park", "ball"])


def build(dtype, blocks=None, slots=6, seq=128):
    """stories260K under "exact"; blocks: a pool of that many 16-position blocks (one max_seq_len sequence is 8)."""
    from llama import Llama

    d = str(need(STORIES))
    kw = dict(max_seq_len=seq, max_batch_size=slots, prefix_cache="exact", dtype=dtype)
    gen = Llama.build(d, d + "/tokenizer.model", **kw)
    if blocks is None:
        return gen
    per = gen.cache.bytes // gen.cache.num_blocks
    return Llama.build(d, d + "/tokenizer.model", kv_cache_memory=blocks * per, **kw)


def pick(results):
    return [(r["generation"], r["tokens"], r["logprobs"]) for r in results]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_dry_pool_preempts_and_gives_a_roomy_pools_tokens_and_logprobs_bitwise(dtype):
    roomy, tight = build(dtype), build(dtype, blocks=9)  # 6-12 prompts of up to 60 new tokens need 30-60 blocks
    for opts in (GREEDY, SEEDED):
        roomy.clear_prefix_cache()
        assert pick(tight.text_completion(PROMPTS, **opts)) == pick(roomy.text_completion(PROMPTS, **opts))
    assert tight.cache.pool.stats["preemptions"] > 0 and tight.cache.pool.used() == 0
    assert roomy.cache.pool.stats["preemptions"] == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_reply_is_cached_and_the_next_turn_equals_a_cold_cache(dtype):
    exact = build(dtype)
    first = exact.text_completion(PROMPTS[:1], **GREEDY)[0]
    assert len(first["tokens"]) > 40
    follow = PROMPTS[0] + first["generation"] + " The end."
    before = exact.cache.pool.stats["cached_tokens"]
    warm = pick(exact.text_completion([follow], **GREEDY))
    prompt_len = len(exact.tokenizer.encode(PROMPTS[0], bos=True, eos=False))
    assert exact.cache.pool.stats["cached_tokens"] - before >= (prompt_len + 32) // 16 * 16  # into the reply
    exact.clear_prefix_cache()
    assert pick(exact.text_completion([follow], **GREEDY)) == warm
