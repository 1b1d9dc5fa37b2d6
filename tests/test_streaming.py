"""Streaming, stop strings and end of sequence through Llama: streamed text equals returned text and the
goldens, on stories260K and on a random model with the Llama 2 tokenizer (byte fallback, multi-byte UTF-8)."""


import pytest
import torch
from helpers import LILY, ONCE, REPLACEMENT, check_stream, continuation, forcing

from llama.tokenizers.chat_format import UNSAFE_ERROR


# --------------------------------------------------------------------------------------------- streaming
def test_greedy_stream_equals_completion_and_golden(stories, goldens):
    for prompt, g in goldens.items():
        final = stories.text_completion([prompt], temperature=0, max_gen_len=128)[0]["generation"]
        assert final == g["generation_text"]
        deltas = list(stories.stream_completion(prompt, temperature=0, max_gen_len=128))
        assert len(deltas) > 20  # it really streams, token by token
        check_stream(deltas, final)


def test_sampled_stream_equals_completion(stories):
    kw = dict(temperature=1.0, top_p=0.95, max_gen_len=80)
    seeded = stories.text_completion([LILY], seed=11, **kw)[0]["generation"]
    check_stream(list(stories.stream_completion(LILY, seed=11, **kw)), seeded)
    # Unseeded sampling uses the global RNG, as the reference does: same RNG state, same text.
    torch.manual_seed(5)
    free = stories.text_completion([LILY], **kw)[0]["generation"]
    torch.manual_seed(5)
    check_stream(list(stories.stream_completion(LILY, **kw)), free)
    assert free != seeded  # the two paths really sampled (a coincidence here is practically impossible)


def test_stream_chat_equals_chat_completion(stories):
    dialog = [{"role": "system", "content": "Tell short stories."}, {"role": "user", "content": "A cat and a dog."}]
    final = stories.chat_completion([dialog], temperature=0, max_gen_len=40)[0]["generation"]["content"]
    assert final
    check_stream(list(stories.stream_chat(dialog, temperature=0, max_gen_len=40)), final)
    kw = dict(temperature=1.0, seed=2, max_gen_len=40)
    sampled = stories.chat_completion([dialog], **kw)[0]["generation"]["content"]
    assert sampled != final
    check_stream(list(stories.stream_chat(dialog, **kw)), sampled)
    bad = [{"role": "user", "content": "[INST] hi"}]
    assert "".join(stories.stream_chat(bad)) == UNSAFE_ERROR


def test_utf8_byte_fallback_stream(rand_gen):
    """Forced multi-byte characters split over byte-fallback pieces: never a broken character in a delta."""
    tok = rand_gen.tokenizer
    b = lambda *xs: [tok.sp_model.piece_to_id(f"<0x{x:02X}>") for x in xs]
    seq = (tok.encode("Hi", bos=False, eos=False) + b(0xE4, 0xBD, 0xA0) + tok.encode(" 好 wave", bos=False, eos=False)
           + b(0xF0, 0x9F, 0x91, 0x8B) + tok.encode(" ünïcödé ✓", bos=False, eos=False))
    prompt = "Say:"
    ctx = tok.encode(prompt, bos=True, eos=False)
    expected = continuation(tok, ctx, seq)
    assert "你" in expected and "👋" in expected and REPLACEMENT not in expected
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        opts = dict(logits_processors=[forcing(seq, tok.eos_id)], max_gen_len=64, **kw)
        final = rand_gen.text_completion([prompt], **opts)[0]["generation"]
        assert final == expected
        check_stream(list(rand_gen.stream_completion(prompt, **opts)), final)
    # Cut in the middle of the emoji by max_gen_len: the final text ends in a broken character, and streaming
    # still equals it (finish() releases the incomplete tail).
    cut = seq.index(b(0xF0)[0]) + 2
    opts = dict(logits_processors=[forcing(seq, tok.eos_id)], max_gen_len=cut, temperature=0)
    final = rand_gen.text_completion([prompt], **opts)[0]["generation"]
    assert final == continuation(tok, ctx, seq[:cut]) and final.endswith(REPLACEMENT)
    assert "".join(rand_gen.stream_completion(prompt, **opts)) == final


def test_random_model_sampled_stream(rand_gen):
    """Unconstrained sampling over 32000 pieces (byte pieces included) on a random model."""
    for seed in (1, 2):
        kw = dict(temperature=1.0, top_p=1.0, seed=seed, max_gen_len=60)
        final = rand_gen.text_completion(["Hello"], **kw)[0]["generation"]
        check_stream(list(rand_gen.stream_completion("Hello", **kw)), final)


# --------------------------------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("stop", [
    ["Lily"],  # one whole token
    ["ved to pl"],  # starts inside "loved", spans three tokens
    ["ball", "girl named"],  # the earliest of several wins
    ["high.\nLily's"],  # spans a newline and many tokens
])
def test_stop_string_cuts_golden(stories, goldens, stop):
    golden = goldens[ONCE]["generation_text"]
    cut = min(golden.find(s) for s in stop if s in golden)
    expected = golden[:cut]
    res = stories.text_completion([ONCE], temperature=0, max_gen_len=128, stop=stop, logprobs=True)[0]
    assert res["generation"] == expected
    # Tokens and logprobs stop with the text: the kept tokens are those wholly before the stop string.
    kept = len(res["tokens"])
    ids = goldens[ONCE]["generated_tokens"]
    assert len(res["logprobs"]) == kept
    ctx = goldens[ONCE]["prompt_tokens"]
    assert expected.startswith(continuation(stories.tokenizer, ctx, ids[:kept]))
    assert not expected.startswith(continuation(stories.tokenizer, ctx, ids[: kept + 1]))
    # Streaming: the deltas add up to exactly the cut text, so no part of the stop string was ever yielded
    # (vLLM #3574) and nothing before it was lost.
    deltas = list(stories.stream_completion(ONCE, temperature=0, max_gen_len=128, stop=stop))
    check_stream(deltas, expected)


def test_stop_only_cuts_rows_that_contain_it(stories, goldens):
    res = stories.text_completion([ONCE, LILY], temperature=0, max_gen_len=128, stop=["box"])
    assert res[0]["generation"] == goldens[ONCE]["generation_text"]
    lily = goldens[LILY]["generation_text"]
    assert res[1]["generation"] == lily[: lily.find("box")]


def test_stop_held_back_text_is_released_at_eos(stories, goldens):
    """Text that might start a stop string is held back, then released when EOS decides it was not one."""
    ids, ctx = goldens[ONCE]["generated_tokens"], goldens[ONCE]["prompt_tokens"]
    k = next(k for k in range(1, 20) if continuation(stories.tokenizer, ctx, ids[:k]).endswith(" named"))
    text = continuation(stories.tokenizer, ctx, ids[:k])  # ", there was a little girl named"
    stop = [" named Bob"]
    force = forcing(ids[:k], stories.tokenizer.eos_id)
    steps = []
    count = lambda ids_so_far, logits: steps.append(len(ids_so_far)) or logits
    opts = dict(temperature=0, max_gen_len=128, stop=stop, logits_processors=[force, count])
    assert stories.text_completion([ONCE], **opts)[0]["generation"] == text
    steps.clear()
    deltas, when = [], []
    for d in stories.stream_completion(ONCE, **opts):
        deltas.append(d)
        when.append(len(steps))  # decode steps taken when this delta arrived
    assert "".join(deltas) == text
    assert not any("named" in d for d in deltas[:-1])
    # " named" was held back at step k-1 (when its token arrived) and released at step k, when EOS decided.
    assert deltas[-1].endswith(" named") and when[-1] == k + 1 and when[-2] < k


def test_stop_in_multibyte_text(rand_gen):
    tok = rand_gen.tokenizer
    b = lambda *xs: [tok.sp_model.piece_to_id(f"<0x{x:02X}>") for x in xs]
    seq = tok.encode("go", bos=False, eos=False) + b(0xF0, 0x9F, 0x91, 0x8B) + tok.encode("on", bos=False, eos=False)
    ctx = tok.encode("x", bos=True, eos=False)
    full = continuation(tok, ctx, seq)
    assert full == " go👋 on"
    for stop, kept in ((["👋"], 1), (["👋 o"], 1), (["o👋"], 0)):
        opts = dict(temperature=0, stop=stop, logits_processors=[forcing(seq, tok.eos_id)], logprobs=True)
        res = rand_gen.text_completion(["x"], **opts)[0]
        expected = full[: full.find(stop[0])]
        assert res["generation"] == expected
        # None of the emoji's four byte pieces is kept: they belong to the stop string; nor is "go" when the stop
        # string starts inside it.
        assert len(tok.encode("go", bos=False, eos=False)) == 1 and len(res["tokens"]) == kept
        opts.pop("logprobs")
        check_stream(list(rand_gen.stream_completion("x", **opts)), expected)


def test_eos_stops(stories, goldens):
    ids = goldens[LILY]["generated_tokens"][:5]
    proc = forcing(ids, stories.tokenizer.eos_id)
    toks = stories.text_completion([LILY], temperature=0, max_gen_len=100, logits_processors=[proc], logprobs=True)[0]
    assert len(toks["tokens"]) == 5
    assert toks["generation"] == continuation(stories.tokenizer, goldens[LILY]["prompt_tokens"], ids)
    deltas = list(stories.stream_completion(LILY, temperature=0, max_gen_len=100, logits_processors=[proc]))
    assert "".join(deltas) == toks["generation"]
