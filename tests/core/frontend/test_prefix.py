"""Reusable prefixes: continuing a Llama.prefill() prefix gives what computing from scratch gives."""


import gc

import pytest
import torch
from helpers import ONCE, SAMPLED, check_stream, continuation


# --------------------------------------------------------------------------------------------- prefixes
def test_prefix_equals_from_scratch(stories):
    prefix = stories.prefill("Once upon a time there was a dog named Max. Max liked bones.")
    prompts = [" One day, Max", " Lily saw the dog", " The"]
    tok = stories.tokenizer
    full = [prefix.tokens + tok.encode(p, bos=False, eos=False) for p in prompts]
    shapes = []
    hook = stories.model.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    try:
        got = stories.text_completion(prompts, prefix=prefix, temperature=0, max_gen_len=30)
    finally:
        hook.remove()
    # The prefix is not recomputed: the prefill forward covers only the prompts' own tokens.
    assert shapes[0] == (3, max(len(f) - len(prefix) for f in full))
    toks, _ = stories.generate(full, max_gen_len=30, temperature=0)
    assert [g["generation"] for g in got] == [continuation(tok, f, t) for f, t in zip(full, toks)]
    # Seeded sampling, echo and logprobs agree with the from-scratch run too.
    kw = dict(seed=3, max_gen_len=30, logprobs=True, echo=True, **{k: v for k, v in SAMPLED.items() if k != "max_gen_len"})
    with_prefix = stories.text_completion(prompts, prefix=prefix, **kw)
    stories.text_completion(["something else entirely"], temperature=0, max_gen_len=20)  # reuses cache slots
    scratch = stories.text_completion([tok.decode(f[1:]) for f in full], **kw)
    for a, b in zip(with_prefix, scratch):
        assert a["generation"] == b["generation"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    # Streaming with the prefix.
    for p, g in zip(prompts, got):
        check_stream(list(stories.stream_completion(p, prefix=prefix, temperature=0, max_gen_len=30)),
                     g["generation"])
    # n samples from a prefix: sample 0 equals the single seeded run.
    many = stories.text_completion(prompts[:1], prefix=prefix, n=3, seed=3, **SAMPLED)
    assert many[0] == stories.text_completion(prompts[:1], prefix=prefix, seed=3, **SAMPLED)[0]


def test_prefix_errors(stories):
    with pytest.raises(ValueError, match="prefix"):
        stories.text_completion([ONCE], prefix="Once upon")
    with pytest.raises(ValueError, match="prefix"):
        stories.prefill([1] * 300)
    with pytest.raises(ValueError, match="prefix"):
        stories.prefill([])
    prefix = stories.prefill([1] + [300] * 250)
    with pytest.raises(ValueError, match="max_seq_len"):
        stories.text_completion([" a b c d e f g h i j"], prefix=prefix)


def test_prefix_prompt_logprobs_never_scores_the_wrong_token(stories):
    """Prefix.prompt_logprobs for a prompt that leaves the prefix early: an error, not another token's score."""
    prefix = stories.prefill("Once upon a time there was a dog.")
    same = prefix.tokens[:5] + stories.tokenizer.encode(" cat", bos=False, eos=False)
    n = 4  # positions the cache would cover; same[4] == prefix.tokens[4]
    assert prefix.prompt_logprobs(same, n) == pytest.approx(prefix.logprobs[:n])
    other = prefix.tokens[:4] + stories.tokenizer.encode(" cat", bos=False, eos=False)
    assert other[4] != prefix.tokens[4]
    with pytest.raises(ValueError, match="leaves this prefix"):
        prefix.prompt_logprobs(other, 4)


# --------------------------------------------------------------------------------------------- prefixes on the pool
def settle(g) -> None:
    """Let earlier tests' prefixes go: some sit in reference cycles (a caught exception's frames), and the runner
    keeps its last sampled requests (which name their prefix) until it samples others; any call then releases
    what they held."""
    g.text_completion(["a"], temperature=0, max_gen_len=1)
    gc.collect()
    g.clear_prefix_cache()


def test_a_prefix_pins_pool_blocks_that_continuations_share(stories):
    """A prefix holds its pool blocks while it lives; a continuation's table names its full blocks (shared, not
    copied) and only the partial last block is the row's own; close() or dropping it gives the blocks back."""
    pool, table = stories.cache.pool, stories.cache.table
    settle(stories)
    before = pool.used()
    prefix = stories.prefill("Once upon a time there was a dog named Max. Max liked bones. He had a red ball too.")
    full = len(prefix) // stories.cache.block_size
    assert full >= 1 and len(prefix) % stories.cache.block_size and pool.used() == before + len(prefix.blocks)
    rows = []
    hook = stories.model.register_forward_pre_hook(lambda m, a: rows.append(table[0].tolist()))
    try:
        got = stories.text_completion([" One day"], prefix=prefix, temperature=0, max_gen_len=10)
    finally:
        hook.remove()
    assert rows[0][:full] == prefix.blocks[:full] and rows[0][full] != prefix.blocks[full]
    full_text = stories.tokenizer.decode(prefix.tokens[1:]) + " One day"
    assert got == stories.text_completion([full_text], temperature=0, max_gen_len=10)
    assert pool.used() == before + len(prefix.blocks)  # the request's references went, the prefix's stay
    prefix.close()
    stories.clear_prefix_cache()  # the next call releases them
    assert pool.used() == before and prefix.reusable(prefix.tokens + [5]) == 0
    assert stories.text_completion([" One day"], prefix=prefix, temperature=0, max_gen_len=10) == got  # recomputed
    again = stories.prefill(prefix.tokens)
    del again
    stories.clear_prefix_cache()
    assert pool.used() == before


def test_prefixes_that_fill_the_pool_fail_requests_clearly_and_a_direct_call_makes_them_stale(stories):
    settle(stories)
    assert stories.cache.pool.used() == 0
    prefixes = [stories.prefill([1] + [300 + i] * 250) for i in range(4)]  # 4 x 16 blocks: the whole pool
    try:
        with pytest.raises(ValueError, match="live prefixes and chat sessions hold 64"):
            stories.text_completion(["Hello"], temperature=0, max_gen_len=4)
        with stories.engine() as engine:  # the engine fails it too, and keeps serving
            with pytest.raises(ValueError, match="live prefixes and chat sessions hold 64"):
                engine.submit("Hello", temperature=0, max_gen_len=4).result(timeout=60)
            prefixes[3].close()
            engine.submit("Hello", temperature=0, max_gen_len=4).result(timeout=60)  # it fits now
    finally:
        for p in prefixes[1:]:
            p.close()
    tail = [7, 8, 9]
    want = stories.generate([prefixes[0].tokens + tail], max_gen_len=5, temperature=0)[0]
    stories.model(torch.tensor([[1, 2, 3]], device=stories.device), 0)  # Meta's direct call writes the slot layout, over the prefix
    assert prefixes[0].stale and prefixes[0].reusable(prefixes[0].tokens + tail) == 0
    assert stories.generate([prefixes[0].tokens + tail], max_gen_len=5, temperature=0)[0] == want
