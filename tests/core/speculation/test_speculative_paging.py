"""Speculative decoding together with prefix caching and preemption (llama/core/speculation/speculative.py, paging.py,
block_pool.py): in a pool too small for every request, drafting requests that share prefixes are preempted,
recomputed and reuse cached blocks, and each output is token for token the one without speculation or a cache;
a rejected draft's positions are never published as a cache key."""

from conftest import CPU_SPECULATION, STORIES, need
from helpers import draft_tally

from llama import Llama
from llama.core.scheduling.block_pool import BlockPool

pytestmark = CPU_SPECULATION

SYSTEM = "Lily and Ben went to the park. Lily and Ben saw a big dog. Lily and Ben"
PROMPTS = [SYSTEM + " played.", SYSTEM + " ran.", SYSTEM + " sang. Lily and Ben", "The cat sat on the mat. The cat",
           "Once upon a time, there was a little girl. The little girl", SYSTEM + " played."]
OPTS = dict(temperature=0.0, max_gen_len=48)


def build(**kw):
    d = str(need(STORIES))
    return Llama.build(d, d + "/tokenizer.model", max_seq_len=128, max_batch_size=4, compile=False, **kw)


def spy_publish(monkeypatch) -> list:
    """The token runs every BlockPool.publish keys (its full blocks' positions), in order."""
    published = []
    publish = BlockPool.publish

    def spy(self, tokens, blocks, salt=b""):
        full_blocks = min(len(tokens) // self.block_size, len(blocks))
        published.append(list(tokens[: full_blocks * self.block_size]))
        return publish(self, tokens, blocks, salt)

    monkeypatch.setattr(BlockPool, "publish", spy)
    return published


def test_drafting_requests_preempted_in_a_small_shared_pool_keep_their_outputs(monkeypatch):
    monkeypatch.setenv("LLAMA_SPECULATIVE_TIMING", "prior")  # drafts by the tokens alone, whatever the load
    tally = draft_tally(monkeypatch.setattr)
    ref = build(prefix_cache="off")
    probe = build(prefix_cache="on", speculative="ngram")
    per_block = probe.cache.bytes // probe.cache.num_blocks
    tight = build(prefix_cache="on", speculative="ngram", kv_cache_memory=10 * per_block)
    assert tight.cache.num_blocks == 10
    want = ref.text_completion(PROMPTS, **OPTS)
    with tight.engine() as engine:
        reqs = [engine.submit(p, **OPTS) for p in PROMPTS]
        assert [r.result(timeout=300)["generation"] for r in reqs] == [w["generation"] for w in want]
        stats = dict(engine.stats)
    # every feature engaged: drafts accepted and rejected, preemptions, cache hits
    assert tally["accepted"] > 0 and tally["drafted"] > tally["accepted"], dict(tally)
    assert stats["preemptions"] > 0, stats
    assert tight.cache.pool.stats["cached_tokens"] > 0, tight.cache.pool.stats


def test_no_rejected_draft_is_published(monkeypatch):
    """Prompts of every length modulo the block size, so requests stop at every position of a block: every key
    published covers accepted tokens only, and the cache under it holds their keys and values (prompts that
    continue each output hit those blocks, where rejected drafts were written, and give the cache-off text)."""
    monkeypatch.setenv("LLAMA_SPECULATIVE_TIMING", "prior")
    tally = draft_tally(monkeypatch.setattr)
    published = spy_publish(monkeypatch)
    ref, probe = build(prefix_cache="off"), build(prefix_cache="on", speculative="ngram")
    per_block = probe.cache.bytes // probe.cache.num_blocks
    on = build(prefix_cache="on", speculative="ngram", kv_cache_memory=160 * per_block)  # room for every output
    prompts = [SYSTEM + " and" * k for k in range(on.cache.pool.block_size)]
    opts = dict(temperature=0.0, max_gen_len=40)
    ids = [ref.tokenizer.encode(p, bos=True, eos=False) for p in prompts]
    want = ref.text_completion(prompts, **opts)
    full = [p + g for p, g in zip(ids, ref.generate(ids, opts["max_gen_len"], temperature=0.0)[0])]
    published.clear()
    with on.engine() as engine:
        assert [engine.submit(p, **opts).result(timeout=300)["generation"] for p in prompts] == \
            [w["generation"] for w in want]
    assert tally["accepted"] > 0 and tally["drafted"] > tally["accepted"], dict(tally)
    assert any(published), "no block was published"
    for tokens in published:
        assert any(f[: len(tokens)] == tokens for f in full), tokens
    replay = [p + w["generation"] for p, w in zip(prompts, want)]
    hits = on.cache.pool.stats["cached_tokens"]
    again = on.text_completion(replay, temperature=0.0, max_gen_len=8, logprobs=True)
    assert on.cache.pool.stats["cached_tokens"] - hits >= len(replay) * 32
    cold = ref.text_completion(replay, temperature=0.0, max_gen_len=8, logprobs=True)
    assert [a["tokens"] for a in again] == [c["tokens"] for c in cold]
    # one position's wrong key and value moves a logprob by far more than the cache's other arithmetic does
    worst = max(abs(x - y) for a, c in zip(again, cold) for x, y in zip(a["logprobs"], c["logprobs"]))
    assert worst < 1e-4, worst
