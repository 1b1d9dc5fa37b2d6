"""Reusable prefixes: continuing a Llama.prefill() prefix gives what computing from scratch gives."""


import pytest
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
