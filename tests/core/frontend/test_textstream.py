"""TextStream (incremental detokenization + stop strings) on the real tokenizers, without a model."""

import json
import random

import pytest
from conftest import GOLDENS, LLAMA2_TOKENIZER, STORIES

from llama.core.frontend.textstream import REPLACEMENT, TextStream
from llama.tokenizers.sentencepiece import Tokenizer

STORIES_TOK = STORIES / "tokenizer.model"
LLAMA2_TOK = LLAMA2_TOKENIZER


def _load(path):
    if not path.exists():
        pytest.skip(f"shared test data {path} is absent (expected beside the repository in ../shared)")
    return Tokenizer(str(path))


@pytest.fixture(scope="module")
def stories_tok():
    return _load(STORIES_TOK)


@pytest.fixture(scope="module")
def llama2_tok():
    return _load(LLAMA2_TOK)


def run(tok, context, ids, stop=()):
    """Feed ids one by one; return (deltas per token, final flush, stream)."""
    s = TextStream(tok, context=context, stop=stop)
    deltas = [s.add(t) for t in ids]
    return deltas, s.finish(), s


def continuation(tok, context, ids):
    return tok.decode(context + ids)[len(tok.decode(context)):]


def test_golden_tokens_stream_to_golden_text(stories_tok):
    if not GOLDENS.exists():
        pytest.skip(f"{GOLDENS} is absent")
    for g in json.loads(GOLDENS.read_text()).values():
        deltas, tail, s = run(stories_tok, g["prompt_tokens"], g["generated_tokens"])
        assert "".join(deltas) + tail == g["generation_text"] == s.text
        assert sum(1 for d in deltas if d) > 100  # released token by token, not at the end


def test_leading_space_kept_after_prompt_and_dropped_after_bos(stories_tok):
    tok = stories_tok
    ids = tok.encode("there was", bos=False, eos=False)
    deltas, tail, _ = run(tok, tok.encode("Once upon a time", bos=True, eos=False), ids)
    assert "".join(deltas) + tail == " there was"
    deltas, tail, _ = run(tok, [tok.bos_id], ids)
    assert "".join(deltas) + tail == "there was"  # as decode() of the whole sequence gives it


def test_random_pieces_with_byte_fallback(llama2_tok):
    """Random token sequences, a third of them byte pieces of real multi-byte characters."""
    tok = llama2_tok
    rng = random.Random(0)
    chars = "你好世界😀👋éü✓ßж"
    byte_ids = lambda ch: [tok.sp_model.piece_to_id(f"<0x{b:02X}>") for b in ch.encode()]
    ctx = tok.encode("Prompt:", bos=True, eos=False)
    for _ in range(60):
        ids = []
        while len(ids) < 30:
            r = rng.random()
            if r < 0.35:
                ids += byte_ids(rng.choice(chars))
            elif r < 0.4:
                ids.append(rng.randrange(3, 259))  # any byte piece, possibly breaking a character
            else:
                ids.append(rng.randrange(259, tok.n_words))
        deltas, tail, s = run(tok, ctx, ids)
        final = continuation(tok, ctx, ids)
        assert "".join(deltas) + tail == final == s.text
        released = ""
        for d in deltas:
            released += d
            assert final.startswith(released)
        if REPLACEMENT not in final:
            assert not any(REPLACEMENT in d for d in deltas + [tail])


def test_incomplete_character_waits_for_its_last_byte(llama2_tok):
    tok = llama2_tok
    ids = [tok.sp_model.piece_to_id(f"<0x{b:02X}>") for b in "👋".encode()]
    deltas, tail, _ = run(tok, [tok.bos_id], ids)
    assert deltas == ["", "", "", "👋"] and tail == ""
    deltas, tail, _ = run(tok, [tok.bos_id], ids[:2])  # generation ended mid-character
    assert deltas == ["", ""] and tail == continuation(tok, [tok.bos_id], ids[:2]) and REPLACEMENT in tail


def test_hold_back_releases_exactly_what_cannot_become_a_stop(stories_tok):
    tok = stories_tok
    ctx = tok.encode("Once upon a time", bos=True, eos=False)
    ids = tok.encode(", there was a little girl named Lily. She", bos=False, eos=False)
    text = continuation(tok, ctx, ids)
    for stop, expected in ((["named Bob"], text), (["named Lily"], text[: text.find("named Lily")]),
                           (["irl named L", "was a lit"], text[: text.find("was a lit")])):
        s = TextStream(tok, context=ctx, stop=stop)
        released = ""
        for k, t in enumerate(ids):
            released += s.add(t)
            sofar = continuation(tok, ctx, ids[: k + 1])
            if not s.stopped:
                # Everything is released except the longest tail that is a proper prefix of a stop string.
                held = max((j for st in stop for j in range(len(st)) if sofar.endswith(st[:j])), default=0)
                assert released == sofar[: len(sofar) - held]
        released += s.finish()
        assert released == expected == s.text


def test_tokens_before_stop(llama2_tok):
    tok = llama2_tok
    bytes_of = lambda ch: [tok.sp_model.piece_to_id(f"<0x{b:02X}>") for b in ch.encode()]
    go, on = tok.encode("go", bos=False, eos=False), tok.encode("on", bos=False, eos=False)
    ids = go + bytes_of("👋") + on + on
    for stop, kept in (("👋", len(go)), ("o👋", 0), ("on", len(go) + 4), ("👋 on on", len(go)), ("x", None)):
        s = TextStream(tok, context=[tok.bos_id], stop=[stop])
        for t in ids:
            s.add(t)
        if kept is None:
            assert not s.stopped
        else:
            assert s.stopped and s.tokens_before_stop() == kept
            assert s.text == continuation(tok, [tok.bos_id], ids).split(stop)[0]
