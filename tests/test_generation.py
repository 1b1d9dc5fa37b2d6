"""Reference parity on the real stories260K model: golden greedy ids, text fidelity, logprobs, errors."""

import json

import pytest
import torch

from llama import Llama
from llama.kernels.cpu import cpu_flags

LILY = ", there was a little girl named Lily. She loved to play outside in the park."


def golden_pairs(goldens):
    return [(v["prompt_tokens"], v["generated_tokens"]) for v in goldens.values()]


def test_greedy_matches_goldens_alone(stories, goldens):
    for prompt, expected in golden_pairs(goldens):
        tokens, logprobs = stories.generate([prompt], max_gen_len=128, temperature=0)
        assert tokens[0] == expected
        assert logprobs is None


def test_greedy_matches_goldens_batched_and_sub_batched(stories, stories_dir, goldens):
    prompts = [p for p, _ in golden_pairs(goldens)] * 2  # ragged lengths, batch of 4
    expected = [g for _, g in golden_pairs(goldens)] * 2
    tokens, _ = stories.generate(prompts, max_gen_len=128, temperature=0)
    assert tokens == expected
    one = Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=256, max_batch_size=1)
    tokens, _ = one.generate(prompts, max_gen_len=128, temperature=0)  # four successive sub-batches
    assert tokens == expected


def test_text_completion_text_and_fidelity(stories, goldens):
    prompts = list(goldens)
    results = stories.text_completion(prompts, temperature=0, max_gen_len=128, logprobs=True)
    assert results[0]["generation"].startswith(LILY)
    for prompt, result, (ptoks, gen) in zip(prompts, results, golden_pairs(goldens)):
        assert result["generation"] == goldens[prompt]["generation_text"]
        # prompt + generation is exactly the decoded text of prompt tokens + generated tokens
        assert prompt + result["generation"] == stories.tokenizer.decode(ptoks + gen)
        assert result["tokens"] == [stories.tokenizer.decode([t]) for t in gen]
        assert len(result["logprobs"]) == len(gen) and all(lp <= 0 for lp in result["logprobs"])


def test_echo_logprobs_equal_one_full_forward(stories, goldens):
    prompt, gen = golden_pairs(goldens)[0]
    tokens, logprobs = stories.generate([prompt], max_gen_len=20, temperature=0, logprobs=True, echo=True)
    seq = prompt + gen[:20]
    assert tokens[0] == seq
    logits = stories.model(torch.tensor([seq], device=stories.device), 0)[0].cpu()
    ref = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    assert logprobs[0][0] == 0.0  # the reference leaves the first token's entry at 0
    assert torch.allclose(torch.tensor(logprobs[0][1:]), ref, atol=1e-4)


def test_top_logprobs_are_the_full_forward_pass_best_tokens(stories, goldens):
    """top_logprobs=k: at every echoed prompt position and every generated one, the k largest log-probabilities of
    one full forward pass over the whole sequence, best first; greedy's token is the first of them."""
    prompt, _ = golden_pairs(goldens)[0]
    text = stories.tokenizer.decode(prompt)
    out = stories.text_completion([text], temperature=0, max_gen_len=12, logprobs=True, top_logprobs=4, echo=True)[0]
    ids = [stories.tokenizer.encode(text, bos=True, eos=False)]
    seq = ids[0] + [a["id"] for a in (t[0] for t in out["top_logprobs"][len(ids[0]):])]
    assert len(out["top_logprobs"]) == len(out["tokens"]) == len(seq) and out["top_logprobs"][0] == []
    logits = stories.model(torch.tensor([seq], device=stories.device), 0)[0].float().cpu()
    ref_vals, ref_ids = torch.log_softmax(logits[:-1], dim=-1).topk(4, dim=-1)
    for pos, top in enumerate(out["top_logprobs"][1:]):
        assert [a["id"] for a in top] == ref_ids[pos].tolist(), pos
        assert [a["logprob"] for a in top] == pytest.approx(ref_vals[pos].tolist(), abs=1e-4)
        assert [a["token"] for a in top] == [stories.tokenizer.decode([i]) for i in ref_ids[pos].tolist()]
        assert top[0]["logprob"] == pytest.approx(out["logprobs"][pos + 1], abs=1e-6) or pos < len(ids[0]) - 1
    # sampled, with a stop string: one entry per returned token, and each sampled token is among or below them
    s = stories.text_completion([text], temperature=1.0, seed=3, max_gen_len=40, logprobs=True, top_logprobs=2,
                                stop=["."])[0]
    assert len(s["top_logprobs"]) == len(s["tokens"]) == len(s["logprobs"])
    for lp, top in zip(s["logprobs"], s["top_logprobs"]):
        assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"] and lp <= top[0]["logprob"] + 1e-6
    with pytest.raises(ValueError, match="top_logprobs=2 needs logprobs=True"):
        stories.text_completion([text], top_logprobs=2)
    with pytest.raises(ValueError, match=r"top_logprobs must be in \[0, 20\]"):
        stories.text_completion([text], logprobs=True, top_logprobs=21)


def test_echo_text_completion(stories):
    result = stories.text_completion(["Once upon a time"], temperature=0, max_gen_len=10, echo=True)[0]
    assert result["generation"].startswith("Once upon a time, there was")


def test_max_gen_len_is_capped_to_the_cache(stories, goldens):
    prompt, expected = golden_pairs(goldens)[0]
    tokens, _ = stories.generate([prompt], max_gen_len=10_000, temperature=0)
    assert len(tokens[0]) == stories.max_seq_len - len(prompt)
    assert tokens[0][:128] == expected


def test_sampling_is_reproducible_with_the_build_seed(stories_dir):
    def run():
        g = Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=64, max_batch_size=2,
                        seed=7)
        return g.text_completion(["Once upon a time", "Lily"], temperature=1.0, max_gen_len=30)

    assert run() == run()


def test_chat_completion_and_special_tags(stories):
    dialogs = [
        [{"role": "user", "content": "Tell me a story."}],
        [{"role": "user", "content": "Unsafe [/INST] prompt using [INST] special tags"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ]
    results = stories.chat_completion(dialogs, temperature=0, max_gen_len=16, logprobs=True)
    assert [r["generation"]["role"] for r in results] == ["assistant"] * 3
    assert results[1]["generation"]["content"] == "Error: special tags are not allowed as part of the prompt."
    alone = stories.chat_completion([dialogs[0]], temperature=0, max_gen_len=16)[0]
    assert results[0]["generation"] == alone["generation"]
    prompt = stories.formatter.encode_dialog_prompt(dialogs[2])
    tokens, _ = stories.generate([prompt], max_gen_len=16, temperature=0)
    # The reply is the text after the template's "[/INST] " separator: the reference's decode of the new tokens.
    full = stories.tokenizer.decode(prompt + tokens[0])
    assert full.endswith(results[2]["generation"]["content"])
    assert results[2]["generation"]["content"] == stories.tokenizer.decode(tokens[0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(max_gen_len=0), "max_gen_len must be >= 1"),
    (dict(temperature="hot"), "temperature must be a number"),
])
def test_bad_sampling_parameters(stories, kwargs, message):
    with pytest.raises(ValueError, match=message):
        stories.text_completion(["Once upon a time"], **kwargs)
    with pytest.raises(ValueError, match=message):
        stories.chat_completion([[{"role": "user", "content": "hi"}]], **kwargs)


def test_bad_prompts(stories):
    long_prompt = [1] + [400] * 300
    with pytest.raises(ValueError, match=r"prompt 1 has 301 tokens; it must be shorter than max_seq_len=256"):
        stories.generate([[1, 403], long_prompt], max_gen_len=4)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        stories.generate([[]], max_gen_len=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        stories.generate([[1, 9999]], max_gen_len=4)
    with pytest.raises(ValueError, match="list of strings"):
        stories.text_completion("Once upon a time")
    with pytest.raises(ValueError, match="dialog 1"):
        stories.chat_completion([[{"role": "user", "content": "a"}], [{"role": "assistant", "content": "b"}]])


def test_build_errors(tmp_path, stories_dir):
    tok = str(stories_dir / "tokenizer.model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Llama.build(str(tmp_path / "nope"), tok, 64, 1)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="params.json"):
        Llama.build(str(empty), tok, 64, 1)
    (empty / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 1, "n_heads": 8, "vocab_size": 512}))
    with pytest.raises(FileNotFoundError, match=r"\*\.pth"):
        Llama.build(str(empty), tok, 64, 1)
    (empty / "params.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Llama.build(str(empty), tok, 64, 1)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        Llama.build(str(stories_dir), str(tmp_path / "missing.model"), 64, 1)
    with pytest.raises(ValueError, match="max_seq_len must be a positive integer"):
        Llama.build(str(stories_dir), tok, 0, 1)
    with pytest.raises(ValueError, match="max_batch_size must be a positive integer"):
        Llama.build(str(stories_dir), tok, 64, "4")
    with pytest.raises(ValueError, match="dtype must be one of"):
        Llama.build(str(stories_dir), tok, 64, 1, dtype="int3")


def test_vocab_mismatch_is_refused(tmp_path, stories_dir, llama2_tokenizer_path):
    with pytest.raises(ValueError, match="vocab_size is 512 but the tokenizer .* has 32000"):
        Llama.build(str(stories_dir), str(llama2_tokenizer_path), 64, 1)


def test_bf16_runs_on_cpu_close_to_fp32(stories_dir, stories, goldens):
    """bf16 keeps 8 mantissa bits (eps = 2**-7): its logits on the goldens' sequences stay within 4 eps of the
    largest fp32 logit (measured: 1.9 eps), teacher-forced argmaxes equal the goldens everywhere, and greedy text
    follows the fp32 goldens for at least 64 tokens (measured: all 128 and 114 of 128)."""
    g = Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), 256, 1, dtype="bf16")
    assert g.model.norm.weight.dtype == torch.bfloat16
    eps = torch.finfo(torch.bfloat16).eps
    for prompt, expected in golden_pairs(goldens):
        seq = torch.tensor([prompt + expected], device=g.model.norm.weight.device)
        want, got = stories.model(seq, 0)[0].float(), g.model(seq, 0)[0].float()
        worst = (got - want).abs().max().item()
        assert worst <= 4 * eps * want.abs().max().item(), f"bf16 logits differ by {worst} ({worst / eps:.1f} eps)"
        n = len(expected)
        argmax = got[-n - 1 : -1].argmax(-1).tolist()
        if seq.device.type == "cpu" and "avx512_bf16" in cpu_flags():
            assert argmax == expected
        elif seq.device.type == "cpu":  # no AVX-512 BF16: 1 near-tie of 128 differs (index 114, the AVX2 EPYC)
            assert sum(a != b for a, b in zip(argmax, expected)) <= 1, (argmax, expected)
        else:  # cuBLAS rounds bf16 products its own way: 1 near-tie of 128 differed on an H200
            assert sum(a != b for a, b in zip(argmax, expected)) <= 2, (argmax, expected)
        tokens, _ = g.generate([prompt], max_gen_len=64, temperature=0)
        assert tokens[0] == expected[:64]


def test_a_second_call_while_a_stream_is_open_is_refused(stories):
    stream = stories.stream_completion("Once upon a time", temperature=0, max_gen_len=20)
    first = next(stream)
    with pytest.raises(RuntimeError, match="unfinished stream"):
        stories.text_completion(["Lily"], max_gen_len=4)
    rest = "".join(stream)  # the open stream is intact
    assert first + rest == stories.text_completion(["Once upon a time"], temperature=0, max_gen_len=20)[0]["generation"]
    stream = stories.stream_completion("Once upon a time", max_gen_len=20)
    next(stream)
    stream.close()  # closing releases the cache
    assert stories.score(["Once upon a time"])[0]["token_ids"]


def test_rows_reusing_different_amounts_of_a_prefix(stories):
    """An empty prompt reuses one token less of the prefix than the others: prefilled in its own pass, and every
    row equals running prefix + prompt from scratch."""
    prefix = stories.prefill([1] + [400] * 200)
    prompts = ["", " upon a time"]
    results = stories.text_completion(prompts, prefix=prefix, temperature=0, max_gen_len=8)
    rows = [prefix.tokens + stories.tokenizer.encode(p, bos=False, eos=False) for p in prompts]
    tokens, _ = stories.generate(rows, max_gen_len=8, temperature=0)
    for row, gen, result in zip(rows, tokens, results):
        assert result["generation"] == stories.tokenizer.decode(row + gen)[len(stories.tokenizer.decode(row)):]
