"""Scoring (Llama.score) against generate's echo logprobs and a plain forward pass, and the perplexity CLI."""

import math

import pytest
import torch
from conftest import STORIES
from helpers import LILY, ONCE


# --------------------------------------------------------------------------------------------- scoring
def test_score_matches_generate_echo_and_forward(stories):
    texts = [ONCE + ", there was a cat.", LILY, "A", "The end of the story was happy and sad.", ONCE]
    got = stories.score(texts)  # five texts, max_batch_size 4: two batches
    assert len(got) == 5
    for text, r in zip(texts, got):
        toks = stories.tokenizer.encode(text, bos=True, eos=False)
        assert r["token_ids"] == toks[1:]
        assert r["tokens"] == [stories.tokenizer.decode([t]) for t in toks[1:]]
        assert len(r["logprobs"]) == len(toks) - 1
        # generate(echo) scores the prompt the reference way
        _, lps = stories.generate([toks], max_gen_len=1, temperature=0, logprobs=True, echo=True)
        assert lps[0][1 : len(toks)] == pytest.approx(r["logprobs"], abs=1e-4)
        # one plain forward pass, log-softmax, gather
        logits = stories.model(torch.tensor([toks], device=stories.device), 0)[0].cpu()
        ref = torch.log_softmax(logits.double(), -1)[torch.arange(len(toks) - 1), torch.tensor(toks[1:])]
        assert r["logprobs"] == pytest.approx(ref.tolist(), abs=1e-4)
        assert r["total_logprob"] == pytest.approx(sum(r["logprobs"]))
        assert r["perplexity"] == pytest.approx(math.exp(-r["total_logprob"] / len(r["logprobs"])))
    # Token lists are accepted, and a text scores the same alone as in a batch.
    alone = stories.score([stories.tokenizer.encode(texts[3], bos=True, eos=False)])[0]
    assert alone["logprobs"] == pytest.approx(got[3]["logprobs"], abs=1e-5)
    # A natural sentence is likelier than the same words shuffled.
    shuffled = stories.score(["the was happy end sad story of and The ."])[0]
    assert got[3]["perplexity"] < shuffled["perplexity"]


def test_score_one_forward_per_batch_and_errors(stories):
    shapes = []
    hook = stories.model.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    try:
        stories.score([ONCE, LILY, "A cat", ONCE + " x", "B b"])
    finally:
        hook.remove()
    assert [s[0] for s in shapes] == [4, 1]
    with pytest.raises(ValueError, match="text 0"):
        stories.score([[1]])
    with pytest.raises(ValueError, match="max_seq_len"):
        stories.score([[1] + [300] * 300])
    with pytest.raises(ValueError, match="texts"):
        stories.score("not a list")


def test_perplexity_cli_sliding_windows(stories, tmp_path, goldens, capsys):
    from llama.cli import perplexity
    text = ONCE + goldens[ONCE]["generation_text"] + LILY
    f = tmp_path / "doc.txt"
    f.write_text(text)
    n_tokens = len(stories.tokenizer.encode(text, bos=False, eos=False))
    assert 128 < n_tokens < stories.max_seq_len
    # A window holding the whole text gives exactly score()'s perplexity.
    whole = perplexity.perplexity(stories, text, window=n_tokens + 1, stride=n_tokens)
    assert whole["tokens"] == n_tokens
    assert whole["perplexity"] == pytest.approx(stories.score([text])[0]["perplexity"], rel=1e-5)
    # Sliding windows: every token scored once, perplexity close to the full-context one (tiny model, short
    # context dependence) but not identical.
    slid = perplexity.perplexity(stories, text, window=64, stride=32)
    assert slid["tokens"] == n_tokens and slid["windows"] == math.ceil((n_tokens - 63) / 32) + 1
    assert slid["perplexity"] != whole["perplexity"]
    assert slid["perplexity"] == pytest.approx(whole["perplexity"], rel=0.25)
    # Command line, as documented.
    out = perplexity.main(str(f), ckpt_dir=str(STORIES), tokenizer_path=str(STORIES / "tokenizer.model"),
                          max_seq_len=64, stride=32, max_batch_size=2)
    assert out["perplexity"] == pytest.approx(slid["perplexity"], rel=1e-5)
    perplexity.cli([str(f), "--ckpt_dir", str(STORIES), "--max_seq_len", "64", "--stride", "32"])
    assert f"perplexity {slid['perplexity']:.4f}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="stride"):
        perplexity.cli([str(f), "--ckpt_dir", str(STORIES), "--max_seq_len", "64", "--stride", "64"])
