"""presence/frequency penalties (OpenAI's formula) and repetition_penalty (transformers' and vLLM's): the same
numbers as the references, the same text alone, batched and through the engine, and refused out of range."""

import pytest
import torch

from helpers import LILY, ONCE, SAMPLED
from llama.core.frontend.params import SamplingParams
from llama.sample.sampling import penalize


def openai_reference(logits, generated, presence, frequency):
    """OpenAI's documented formula, written out per token:
    mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = logits.clone()
    for j in range(len(out)):
        c = generated.count(j)
        out[j] = out[j] - c * frequency - float(c > 0) * presence
    return out


def test_presence_and_frequency_match_openai_formula():
    torch.manual_seed(0)
    logits = torch.randn(50)
    generated = [3, 7, 7, 7, 12, 3, 49]
    got = penalize(logits.clone(), [1, 2, 3], generated, presence=0.7, frequency=-1.3)
    torch.testing.assert_close(got, openai_reference(logits, generated, 0.7, -1.3), rtol=0, atol=1e-6)
    # the prompt does not count for these two
    assert torch.equal(penalize(logits.clone(), [5, 5, 5], [], presence=2.0, frequency=2.0), logits)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_matches_transformers(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(1)
    logits = torch.randn(64) * 3
    prompt, generated = [4, 9, 9, 20], [20, 33, 4, 63]
    ours = penalize(logits.clone(), prompt, generated, repetition=penalty)
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + generated]), logits.clone()[None])[0]
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, logits)


def reference_processor(prompt, presence=0.0, frequency=0.0, repetition=1.0):
    """A logits processor applying both references (transformers' class, then OpenAI's formula) in plain code."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    def proc(generated, logits):
        row = logits.float()
        if repetition != 1:
            row = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([prompt + generated], device=row.device),
                                                              row[None])[0]
        return openai_reference(row, generated, presence, frequency).to(logits.dtype)

    return proc


def test_generation_equals_reference_processor(stories):
    prompt = stories.tokenizer.encode(LILY, bos=True, eos=False)
    kw = dict(temperature=0.0, max_gen_len=40)
    plain = stories.text_completion([LILY], **kw)[0]["generation"]
    for pen in (dict(presence=0.8, frequency=1.5), dict(repetition=1.8)):
        ref = stories.text_completion([LILY], logits_processors=[reference_processor(prompt, **pen)], **kw)
        ours = stories.text_completion([LILY], **{k + "_penalty": v for k, v in pen.items()}, **kw)
        assert ours[0]["generation"] == ref[0]["generation"]
        assert ours[0]["generation"] != plain  # the penalty changed something


def test_penalties_batch_invariant_on_every_path(stories):
    pen = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3, seed=11, **SAMPLED)
    alone = stories.text_completion([LILY], **pen)[0]["generation"]
    batch = stories.text_completion([ONCE, LILY, "The dog"], **{**pen, "seed": [3, 11, 4],
                                                              "repetition_penalty": [1.0, 1.3, 2.0]})
    assert batch[1]["generation"] == alone
    assert "".join(stories.stream_completion(LILY, **pen)) == alone
    with stories.engine() as engine:
        others = [engine.submit(p, seed=1, **SAMPLED) for p in (ONCE, "A cat")]
        r = engine.submit(LILY, **pen)
        assert r.result()["generation"] == alone
        [o.result() for o in others]
    dialog = [{"role": "user", "content": "Tell me a story."}]
    chat = stories.chat_completion([dialog], **pen)[0]["generation"]["content"]
    assert stories.chat_completion([[{"role": "user", "content": "Hi"}], dialog], **pen)[1]["generation"][
        "content"] == chat


@pytest.mark.parametrize("kw, msg", [
    (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\]"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in \\[-2, 2\\]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty="2"), "repetition_penalty must be a number"),
])
def test_out_of_range_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)
