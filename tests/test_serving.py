"""Issue 4: serving features of Llama, proven on the real stories260K model and on a random-weight model with the
Llama 2 tokenizer (byte fallback, multi-byte UTF-8).

Every expected value is computed independently of the feature under test: the goldens from Meta's reference,
`generate` on explicitly concatenated tokens, a plain forward pass, or the same request run alone.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from llama import Llama
from llama.demo import write_random_checkpoint
from llama.chat import UNSAFE_ERROR

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
STORIES = SHARED / "models" / "stories260K"
LLAMA2_TOKENIZER = SHARED / "tokenizers" / "llama2" / "tokenizer.model"
GOLDENS = SHARED / "goldens" / "stories260K_greedy.json"

ONCE = "Once upon a time"
LILY = "Lily and Ben went to the park"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one thread is ~20x faster than two on a shared, busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _need(*paths):
    for p in paths:
        if not p.exists():
            pytest.skip(f"shared test data {p} is absent (expected beside the repository in ../shared)")


def build_stories(max_batch_size=4, max_seq_len=256):
    _need(STORIES / "consolidated.00.pth", STORIES / "tokenizer.model")
    return Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=max_seq_len,
                       max_batch_size=max_batch_size)


@pytest.fixture(scope="module")
def gen():
    return build_stories()


@pytest.fixture(scope="module")
def goldens():
    _need(GOLDENS)
    return json.loads(GOLDENS.read_text())


@pytest.fixture(scope="module")
def rand_gen(tmp_path_factory):
    """A random-weight model with the real 32000-piece Llama 2 tokenizer, built in a temp dir."""
    _need(LLAMA2_TOKENIZER)
    d = tmp_path_factory.mktemp("rand_llama2")
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "norm_eps": 1e-5,
              "vocab_size": 32000}
    write_random_checkpoint(d, params, tokenizer_path=LLAMA2_TOKENIZER, std=0.5)
    return Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=128, max_batch_size=4)


def stream_deltas(it):
    return list(it)


def forcing(seq, eos_id):
    """A logits processor that forces `seq`, then EOS: makes a random model's output fully determined."""
    def proc(ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[seq[len(ids)] if len(ids) < len(seq) else eos_id] = 0.0
        return out
    return proc


def continuation(tok, context, generated):
    """Text the generated tokens add after the context: what completion and streaming must both return."""
    return tok.decode(context + generated)[len(tok.decode(context)):]


def check_stream(deltas, final):
    assert "".join(deltas) == final
    if REPLACEMENT not in final:
        assert not any(REPLACEMENT in d for d in deltas), deltas


# --------------------------------------------------------------------------------------------- streaming
def test_greedy_stream_equals_completion_and_golden(gen, goldens):
    for prompt, g in goldens.items():
        final = gen.text_completion([prompt], temperature=0, max_gen_len=128)[0]["generation"]
        assert final == g["generation_text"]
        deltas = stream_deltas(gen.stream_completion(prompt, temperature=0, max_gen_len=128))
        assert len(deltas) > 20  # it really streams, token by token
        check_stream(deltas, final)


def test_sampled_stream_equals_completion(gen):
    kw = dict(temperature=1.0, top_p=0.95, max_gen_len=80)
    seeded = gen.text_completion([LILY], seed=11, **kw)[0]["generation"]
    check_stream(stream_deltas(gen.stream_completion(LILY, seed=11, **kw)), seeded)
    # Unseeded sampling uses the global RNG, as the reference does: same RNG state, same text.
    torch.manual_seed(5)
    free = gen.text_completion([LILY], **kw)[0]["generation"]
    torch.manual_seed(5)
    check_stream(stream_deltas(gen.stream_completion(LILY, **kw)), free)
    assert free != seeded  # the two paths really sampled (a coincidence here is practically impossible)


def test_stream_chat_equals_chat_completion(gen):
    dialog = [{"role": "system", "content": "Tell short stories."}, {"role": "user", "content": "A cat and a dog."}]
    final = gen.chat_completion([dialog], temperature=0, max_gen_len=40)[0]["generation"]["content"]
    assert final
    check_stream(stream_deltas(gen.stream_chat(dialog, temperature=0, max_gen_len=40)), final)
    kw = dict(temperature=1.0, seed=2, max_gen_len=40)
    sampled = gen.chat_completion([dialog], **kw)[0]["generation"]["content"]
    assert sampled != final
    check_stream(stream_deltas(gen.stream_chat(dialog, **kw)), sampled)
    bad = [{"role": "user", "content": "[INST] hi"}]
    assert "".join(gen.stream_chat(bad)) == UNSAFE_ERROR


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
        check_stream(stream_deltas(rand_gen.stream_completion(prompt, **opts)), final)
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
        check_stream(stream_deltas(rand_gen.stream_completion("Hello", **kw)), final)


# --------------------------------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("stop", [
    ["Lily"],  # one whole token
    ["ved to pl"],  # starts inside "loved", spans three tokens
    ["ball", "girl named"],  # the earliest of several wins
    ["high.\nLily's"],  # spans a newline and many tokens
])
def test_stop_string_cuts_golden(gen, goldens, stop):
    golden = goldens[ONCE]["generation_text"]
    cut = min(golden.find(s) for s in stop if s in golden)
    expected = golden[:cut]
    res = gen.text_completion([ONCE], temperature=0, max_gen_len=128, stop=stop, logprobs=True)[0]
    assert res["generation"] == expected
    # Tokens and logprobs stop with the text: the kept tokens are those wholly before the stop string.
    kept = len(res["tokens"])
    ids = goldens[ONCE]["generated_tokens"]
    assert len(res["logprobs"]) == kept
    ctx = goldens[ONCE]["prompt_tokens"]
    assert expected.startswith(continuation(gen.tokenizer, ctx, ids[:kept]))
    assert not expected.startswith(continuation(gen.tokenizer, ctx, ids[: kept + 1]))
    # Streaming: the deltas add up to exactly the cut text, so no part of the stop string was ever yielded
    # (vLLM #3574) and nothing before it was lost.
    deltas = stream_deltas(gen.stream_completion(ONCE, temperature=0, max_gen_len=128, stop=stop))
    check_stream(deltas, expected)


def test_stop_only_cuts_rows_that_contain_it(gen, goldens):
    res = gen.text_completion([ONCE, LILY], temperature=0, max_gen_len=128, stop=["box"])
    assert res[0]["generation"] == goldens[ONCE]["generation_text"]
    lily = goldens[LILY]["generation_text"]
    assert res[1]["generation"] == lily[: lily.find("box")]


def test_stop_held_back_text_is_released_at_eos(gen, goldens):
    """Text that might start a stop string is held back, then released when EOS decides it was not one."""
    ids, ctx = goldens[ONCE]["generated_tokens"], goldens[ONCE]["prompt_tokens"]
    k = next(k for k in range(1, 20) if continuation(gen.tokenizer, ctx, ids[:k]).endswith(" named"))
    text = continuation(gen.tokenizer, ctx, ids[:k])  # ", there was a little girl named"
    stop = [" named Bob"]
    force = forcing(ids[:k], gen.tokenizer.eos_id)
    steps = []
    count = lambda ids_so_far, logits: steps.append(len(ids_so_far)) or logits
    opts = dict(temperature=0, max_gen_len=128, stop=stop, logits_processors=[force, count])
    assert gen.text_completion([ONCE], **opts)[0]["generation"] == text
    steps.clear()
    deltas, when = [], []
    for d in gen.stream_completion(ONCE, **opts):
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
        check_stream(stream_deltas(rand_gen.stream_completion("x", **opts)), expected)


def test_eos_stops(gen, goldens):
    ids = goldens[LILY]["generated_tokens"][:5]
    proc = forcing(ids, gen.tokenizer.eos_id)
    toks = gen.text_completion([LILY], temperature=0, max_gen_len=100, logits_processors=[proc], logprobs=True)[0]
    assert len(toks["tokens"]) == 5
    assert toks["generation"] == continuation(gen.tokenizer, goldens[LILY]["prompt_tokens"], ids)
    deltas = stream_deltas(gen.stream_completion(LILY, temperature=0, max_gen_len=100, logits_processors=[proc]))
    assert "".join(deltas) == toks["generation"]


# --------------------------------------------------------------------------------------------- seeds, n
SAMPLED = dict(temperature=1.0, top_p=1.0, max_gen_len=48)


def test_seed_independent_of_batch_and_max_batch_size(gen):
    alone = gen.text_completion([LILY], seed=7, **SAMPLED)[0]["generation"]
    batch = gen.text_completion([ONCE, LILY, "The cat", "A"], seed=[None, 7, 3, 4], **SAMPLED)
    assert batch[1]["generation"] == alone
    assert len({r["generation"] for r in batch[1:]}) == 3  # other seeds give other texts
    g1, g3 = build_stories(max_batch_size=1), build_stories(max_batch_size=3)
    assert g1.text_completion([LILY], seed=7, **SAMPLED)[0]["generation"] == alone
    # Fourth of five prompts with max_batch_size 3: runs in the second sub-batch, beside a different prompt.
    res = g3.text_completion(["x", "y z w", "q", LILY, ONCE], seed=7, **SAMPLED)
    assert res[3]["generation"] == alone
    # And through streaming.
    assert "".join(g3.stream_completion(LILY, seed=7, **SAMPLED)) == alone


def test_seed_in_chat(gen):
    dialog = [{"role": "user", "content": "Tell me a story."}]
    other = [{"role": "user", "content": "Who is Ben?"}]
    alone = gen.chat_completion([dialog], seed=9, **SAMPLED)[0]["generation"]["content"]
    batch = gen.chat_completion([other, dialog], seed=[1, 9], **SAMPLED)
    assert batch[1]["generation"]["content"] == alone


def test_n_samples_prompt_major_and_reproducible(gen):
    n = 3
    res = gen.text_completion([ONCE, LILY], n=n, seed=5, **SAMPLED)
    assert len(res) == 2 * n
    assert res == gen.text_completion([ONCE, LILY], n=n, seed=5, **SAMPLED)
    # Sample 0 of prompt i is what prompt i alone gives with that seed: so result[i * n + j] is prompt-major.
    assert res[0]["generation"] == gen.text_completion([ONCE], seed=5, **SAMPLED)[0]["generation"]
    assert res[n]["generation"] == gen.text_completion([LILY], seed=5, **SAMPLED)[0]["generation"]
    for i in range(2):
        assert len({r["generation"] for r in res[i * n : (i + 1) * n]}) == n  # samples differ at temperature 1
    # More rows than max_batch_size: samples split over sub-batches still give the same texts.
    g2 = build_stories(max_batch_size=2)
    assert g2.text_completion([ONCE, LILY], n=n, seed=5, **SAMPLED) == res
    # Chat: prompt-major too.
    dialogs = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "A dog?"}]]
    chat = gen.chat_completion(dialogs, n=2, seed=4, **SAMPLED)
    assert chat[2]["generation"] == gen.chat_completion(dialogs[1:], seed=4, **SAMPLED)[0]["generation"]


def test_n_samples_prefill_once(gen):
    shapes = []
    hook = gen.model.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    try:
        res = gen.text_completion([ONCE], n=4, temperature=1.0, max_gen_len=6)
    finally:
        hook.remove()
    assert len(res) == 4
    prompt_len = len(gen.tokenizer.encode(ONCE, bos=True, eos=False))
    assert shapes[0] == (1, prompt_len)  # one prefill row, copied to the other three
    assert all(s == (4, 1) for s in shapes[1:])


def test_max_gen_len_per_prompt(gen):
    res = gen.text_completion([ONCE, LILY, ONCE], temperature=0, max_gen_len=[3, 9, 1], logprobs=True)
    assert [len(r["tokens"]) for r in res] == [3, 9, 1]
    ids = [3, 9, 1]
    out = gen.chat_completion([[{"role": "user", "content": "Hi"}]] * 3, temperature=0, max_gen_len=ids,
                              logprobs=True)
    assert [len(r["tokens"]) for r in out] == ids


# --------------------------------------------------------------------------------------------- logits processors
def test_logits_processor_bans_token(gen, goldens):
    banned = goldens[ONCE]["generated_tokens"][0]  # the greedy first token, frequent in the golden text
    seen = []

    def ban(ids, logits):
        seen.append(list(ids))
        logits = logits.clone()
        logits[banned] = float("-inf")
        return logits

    res = gen.text_completion([ONCE, LILY], temperature=0, max_gen_len=40, logits_processors=[ban])
    free = gen.text_completion([ONCE], temperature=0, max_gen_len=40)[0]["generation"]
    assert res[0]["generation"] != free
    toks, _ = gen.generate([goldens[ONCE]["prompt_tokens"]], 40, temperature=0)
    assert banned in toks[0]
    # The processor saw each row's generated tokens so far, growing one at a time; the banned id never appears.
    assert sorted({len(s) for s in seen}) == list(range(40))
    assert all(banned not in s for s in seen)


# --------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("name,value", [
    ("top_k", -1), ("top_k", 1.5), ("stop", [""]), ("stop", [3]), ("seed", "x"), ("seed", 1.5), ("seed", 2 ** 70),
    ("n", 0), ("n", "2"), ("max_gen_len", [5]), ("max_gen_len", 0), ("logits_processors", [3]),
    ("logits_processors", "abc"), ("temperature", -1.0), ("top_p", 0.0), ("seed", [1, 2, 3]),
])
def test_bad_parameters_raise_value_error_naming_them(gen, name, value):
    prompts = [ONCE, LILY]
    dialogs = [[{"role": "user", "content": "Hi"}]] * 2
    with pytest.raises(ValueError, match=name):
        gen.text_completion(prompts, **{name: value})
    with pytest.raises(ValueError, match=name):
        gen.chat_completion(dialogs, **{name: value})
    if name != "n" and not (isinstance(value, list) and name in ("max_gen_len", "seed")):
        with pytest.raises(ValueError, match=name):
            gen.stream_completion(ONCE, **{name: value})  # raised at the call, before any iteration
        with pytest.raises(ValueError, match=name):
            gen.chat_session().send("Hi", **{name: value})


def test_list_valued_parameters_apply_to_every_prompt(gen, goldens):
    """stop and logits_processors are lists by nature: a flat list is for every prompt, a list of lists per prompt."""
    keep = lambda ids, logits: logits
    res = gen.text_completion([ONCE, LILY], temperature=0, max_gen_len=128, stop=["Lily", "box"],
                              logits_processors=[keep])
    once, lily = goldens[ONCE]["generation_text"], goldens[LILY]["generation_text"]
    assert [r["generation"] for r in res] == [once[: once.find("Lily")], lily[: lily.find("box")]]
    res = gen.text_completion([ONCE, LILY], temperature=0, max_gen_len=128, stop=[["Lily"], []])
    assert [r["generation"] for r in res] == [once[: once.find("Lily")], lily]
    with pytest.raises(ValueError, match="stop"):
        gen.text_completion([ONCE, LILY], stop=[["Lily"]])


# --------------------------------------------------------------------------------------------- scoring
def test_score_matches_generate_echo_and_forward(gen):
    texts = [ONCE + ", there was a cat.", LILY, "A", "The end of the story was happy and sad.", ONCE]
    got = gen.score(texts)  # five texts, max_batch_size 4: two batches
    assert len(got) == 5
    for text, r in zip(texts, got):
        toks = gen.tokenizer.encode(text, bos=True, eos=False)
        assert r["token_ids"] == toks[1:]
        assert r["tokens"] == [gen.tokenizer.decode([t]) for t in toks[1:]]
        assert len(r["logprobs"]) == len(toks) - 1
        # generate(echo) scores the prompt the reference way
        _, lps = gen.generate([toks], max_gen_len=1, temperature=0, logprobs=True, echo=True)
        assert lps[0][1 : len(toks)] == pytest.approx(r["logprobs"], abs=1e-4)
        # one plain forward pass, log-softmax, gather
        logits = gen.model(torch.tensor([toks]), 0)[0]
        ref = torch.log_softmax(logits.double(), -1)[torch.arange(len(toks) - 1), torch.tensor(toks[1:])]
        assert r["logprobs"] == pytest.approx(ref.tolist(), abs=1e-4)
        assert r["total_logprob"] == pytest.approx(sum(r["logprobs"]))
        assert r["perplexity"] == pytest.approx(math.exp(-r["total_logprob"] / len(r["logprobs"])))
    # Token lists are accepted, and a text scores the same alone as in a batch.
    alone = gen.score([gen.tokenizer.encode(texts[3], bos=True, eos=False)])[0]
    assert alone["logprobs"] == pytest.approx(got[3]["logprobs"], abs=1e-5)
    # A natural sentence is likelier than the same words shuffled.
    shuffled = gen.score(["the was happy end sad story of and The ."])[0]
    assert got[3]["perplexity"] < shuffled["perplexity"]


def test_score_one_forward_per_batch_and_errors(gen):
    shapes = []
    hook = gen.model.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    try:
        gen.score([ONCE, LILY, "A cat", ONCE + " x", "B b"])
    finally:
        hook.remove()
    assert [s[0] for s in shapes] == [4, 1]
    with pytest.raises(ValueError, match="text 0"):
        gen.score([[1]])
    with pytest.raises(ValueError, match="max_seq_len"):
        gen.score([[1] + [300] * 300])
    with pytest.raises(ValueError, match="texts"):
        gen.score("not a list")


def test_perplexity_cli_sliding_windows(gen, tmp_path, goldens, capsys):
    from llama import perplexity
    text = ONCE + goldens[ONCE]["generation_text"] + LILY
    f = tmp_path / "doc.txt"
    f.write_text(text)
    n_tokens = len(gen.tokenizer.encode(text, bos=False, eos=False))
    assert 128 < n_tokens < gen.max_seq_len
    # A window holding the whole text gives exactly score()'s perplexity.
    whole = perplexity.perplexity(gen, text, window=n_tokens + 1, stride=n_tokens)
    assert whole["tokens"] == n_tokens
    assert whole["perplexity"] == pytest.approx(gen.score([text])[0]["perplexity"], rel=1e-5)
    # Sliding windows: every token scored once, perplexity close to the full-context one (tiny model, short
    # context dependence) but not identical.
    slid = perplexity.perplexity(gen, text, window=64, stride=32)
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


# --------------------------------------------------------------------------------------------- prefixes
def test_prefix_equals_from_scratch(gen):
    prefix = gen.prefill("Once upon a time there was a dog named Max. Max liked bones.")
    prompts = [" One day, Max", " Lily saw the dog", " The"]
    tok = gen.tokenizer
    full = [prefix.tokens + tok.encode(p, bos=False, eos=False) for p in prompts]
    shapes = []
    hook = gen.model.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    try:
        got = gen.text_completion(prompts, prefix=prefix, temperature=0, max_gen_len=30)
    finally:
        hook.remove()
    # The prefix is not recomputed: the prefill forward covers only the prompts' own tokens.
    assert shapes[0] == (3, max(len(f) - len(prefix) for f in full))
    toks, _ = gen.generate(full, max_gen_len=30, temperature=0)
    assert [g["generation"] for g in got] == [continuation(tok, f, t) for f, t in zip(full, toks)]
    # Seeded sampling, echo and logprobs agree with the from-scratch run too.
    kw = dict(seed=3, max_gen_len=30, logprobs=True, echo=True, **{k: v for k, v in SAMPLED.items() if k != "max_gen_len"})
    with_prefix = gen.text_completion(prompts, prefix=prefix, **kw)
    gen.text_completion(["something else entirely"], temperature=0, max_gen_len=20)  # reuses cache slots
    scratch = gen.text_completion([tok.decode(f[1:]) for f in full], **kw)
    for a, b in zip(with_prefix, scratch):
        assert a["generation"] == b["generation"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)
    # Streaming with the prefix.
    for p, g in zip(prompts, got):
        check_stream(stream_deltas(gen.stream_completion(p, prefix=prefix, temperature=0, max_gen_len=30)),
                     g["generation"])
    # n samples from a prefix: sample 0 equals the single seeded run.
    many = gen.text_completion(prompts[:1], prefix=prefix, n=3, seed=3, **SAMPLED)
    assert many[0] == gen.text_completion(prompts[:1], prefix=prefix, seed=3, **SAMPLED)[0]


def test_prefix_errors(gen):
    with pytest.raises(ValueError, match="prefix"):
        gen.text_completion([ONCE], prefix="Once upon")
    with pytest.raises(ValueError, match="prefix"):
        gen.prefill([1] * 300)
    with pytest.raises(ValueError, match="prefix"):
        gen.prefill([])
    prefix = gen.prefill([1] + [300] * 250)
    with pytest.raises(ValueError, match="max_seq_len"):
        gen.text_completion([" a b c d e f g h i j"], prefix=prefix)


# --------------------------------------------------------------------------------------------- chat sessions
def test_chat_session_equals_chat_completion(gen):
    session = gen.chat_session(system="You tell stories.")
    messages = ["Tell me about a cat.", "What did the cat eat?", "And then?", "Who is Lily?"]
    kw = dict(temperature=0, max_gen_len=30)
    fmt = gen.formatter
    for turn, msg in enumerate(messages):
        before = list(session.dialog)
        cached = session.cache.tokens if session.cache else []
        if turn % 2:
            reply = "".join(session.stream(msg, **kw))
        else:
            reply = session.send(msg, **kw)
        dialog = before + [{"role": "user", "content": msg}]
        assert session.dialog == dialog + [{"role": "assistant", "content": reply}]
        assert reply == gen.chat_completion([dialog], **kw)[0]["generation"]["content"]
        prompt = fmt.encode_dialog_prompt(dialog)
        if turn == 0:
            assert session.last_prefilled == len(prompt)
        else:
            # Only the new tokens were computed: at least the whole previous prompt came from the cache...
            assert 0 < session.last_prefilled <= len(prompt) - len(fmt.encode_dialog_prompt(before[:-1]))
            # ...and exactly the tokens after the common start of the cached conversation and this prompt.
            common = next((i for i, (a, b) in enumerate(zip(cached, prompt)) if a != b), min(len(cached), len(prompt)))
            assert session.last_prefilled == len(prompt) - min(common, len(prompt) - 1)


def test_chat_session_sampled_and_stop(gen):
    session = gen.chat_session()
    kw = dict(temperature=1.0, top_p=0.9, seed=21, max_gen_len=40, stop=["."])
    for msg in ("Tell me a story.", "More please."):
        dialog = session.dialog + [{"role": "user", "content": msg}]
        reply = session.send(msg, **kw)
        assert "." not in reply
        assert reply == gen.chat_completion([dialog], **kw)[0]["generation"]["content"]


def test_chat_session_too_long(gen):
    session = gen.chat_session()
    session.send("Hi", temperature=0, max_gen_len=5)
    before = list(session.dialog)
    with pytest.raises(ValueError, match="max_seq_len"):
        session.send("word " * 300, temperature=0)
    assert session.dialog == before  # the failed turn left the conversation as it was
    with pytest.raises(ValueError, match="message"):
        session.send(42)
    with pytest.raises(ValueError, match="echo is not available in a chat session"):
        session.send("Hi again", echo=True, logprobs=True)
    # Still usable, and still equal to the from-scratch answer.
    reply = session.send("Bye", temperature=0, max_gen_len=10)
    dialog = before + [{"role": "user", "content": "Bye"}]
    assert reply == gen.chat_completion([dialog], temperature=0, max_gen_len=10)[0]["generation"]["content"]


# --------------------------------------------------------------------------------------------- model parallel
def mp_outputs(g):
    """Seeded, streamed, stopped and chat outputs: what must not change with the model-parallel size."""
    kw = dict(temperature=1.0, top_p=1.0, max_gen_len=40)
    res = [r["generation"] for r in g.text_completion([ONCE, "Lily"], seed=[7, 8], **kw)]
    res.append("".join(g.stream_completion(ONCE, seed=7, stop=["Lily"], **kw)))
    session = g.chat_session()
    return res + [session.send("Hi", temperature=0, max_gen_len=10), session.send("More", seed=3, **kw)]


MP_SCRIPT = r'''
import json, sys, torch
torch.set_num_threads(1)
import torch.distributed as dist
from llama import Llama
sys.path.insert(0, sys.argv[3])
from test_serving import mp_outputs
ckpt, out = sys.argv[1], sys.argv[2]
res = mp_outputs(Llama.build(ckpt, ckpt + "/tokenizer.model", max_seq_len=128, max_batch_size=2))
if dist.get_rank() == 0:
    json.dump(res, open(out, "w"))
'''


def test_seeded_outputs_identical_at_mp2(tmp_path):
    """Two model-parallel ranks (torchrun, gloo on CPU) give the same texts as one process."""
    import subprocess
    import sys
    _need(STORIES / "consolidated.00.pth")
    script, out = tmp_path / "mp.py", tmp_path / "mp2.json"
    script.write_text(MP_SCRIPT)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script),
                           str(STORIES), str(out), str(root / "tests")], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mp2 = json.loads(out.read_text())
    mp1 = mp_outputs(build_stories(max_batch_size=2, max_seq_len=128))
    assert mp2 == mp1
    assert mp1[2] == mp1[0][: mp1[0].find("Lily")] and mp1[0] != mp1[1]


def test_prefix_prompt_logprobs_never_scores_the_wrong_token(gen):
    """Prefix.prompt_logprobs for a prompt that leaves the prefix early: an error, not another token's score."""
    prefix = gen.prefill("Once upon a time there was a dog.")
    same = prefix.tokens[:5] + gen.tokenizer.encode(" cat", bos=False, eos=False)
    n = 4  # positions the cache would cover; same[4] == prefix.tokens[4]
    assert prefix.prompt_logprobs(same, n) == pytest.approx(prefix.logprobs[:n])
    other = prefix.tokens[:4] + gen.tokenizer.encode(" cat", bos=False, eos=False)
    assert other[4] != prefix.tokens[4]
    with pytest.raises(ValueError, match="leaves this prefix"):
        prefix.prompt_logprobs(other, 4)
