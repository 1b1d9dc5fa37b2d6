"""llama.llama4.generation (llama-models' llama4 generation path): Llama4.build on a Meta-layout Scout-shaped
checkpoint with Llama 4's full vocabulary (tokenizer: the one llama-models ships), then generate, completion and
chat_completion at temperature 0: Meta's greedy ids (tests/llama4_reference.py) and our Llama facade's, in Meta's
steps (one result per item, prompts ragged, echo, logprobs, a logits_processor that ends an item early). Every
refusal names what it refuses."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import STORIES, need
from llama.llama4 import generation
from llama.llama4.datatypes import LLMInput
from llama.llama4.generation import GenerationResult, Llama4
from llama4_reference import SHAPES, meta_greedy, meta_reference

llama_models = pytest.importorskip("llama_models", reason="llama-models (Meta's reference code) is a test dependency")

PARAMS = {**SHAPES["scout"], "vocab_size": 202048}  # Llama 4's tokenizer: its chat format's special tokens


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(Meta's reference, its checkpoint directory, Llama4.build of it, prompts of 12, 7 and 9 tokens)."""
    ref = meta_reference(PARAMS, seed=6)
    d = tmp_path_factory.mktemp("scout_vocab")
    torch.save(ref.state_dict(), d / "consolidated.00.pth")
    (d / "params.json").write_text(json.dumps(PARAMS))
    g = Llama4.build(str(d), 64, 3)
    prompts = [torch.randint(3, 200000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 7, 9)]
    return ref, d, g, prompts


def outputs(steps, j):
    return [r.token for s in steps for r in s if r.batch_idx == j and r.source == "output" and not r.ignore_token]


def test_build_takes_llama_models_tokenizer_and_metas_args(built):
    ref, d, g, prompts = built
    assert g.tokenizer.n_words == 202048 and g.args.vocab_size == 202048 and g.args.max_seq_len == 64
    assert g.llama.model is g.model and g.llama.max_batch_size == 3
    assert generation.tokenizer_path(d).endswith("llama_models/llama4/tokenizer.model")


def test_generate_yields_metas_steps_over_ragged_prompts(built):
    """Steps from the shortest prompt's end to the longest's + max_gen_len: positions inside a prompt are its
    tokens, ignored; every item's own tokens are our facade's greedy ids of that many tokens, the longest's Meta's."""
    ref, d, g, prompts = built
    steps = list(g.generate([LLMInput(p) for p in prompts], temperature=0, max_gen_len=3))
    assert len(steps) == 12 + 3 - 7 and all([r.batch_idx for r in s] == [0, 1, 2] for s in steps)
    assert all(isinstance(r, GenerationResult) and not r.finished and r.logprobs is None for s in steps for r in s)
    assert [s[0].token for s in steps[:5]] == prompts[0][7:12] and all(s[0].ignore_token for s in steps[:5])
    assert steps[0][1].text == g.tokenizer.decode([steps[0][1].token])
    assert outputs(steps, 0) == meta_greedy(ref, prompts[0], 3)
    for j, p in enumerate(prompts):
        assert outputs(steps, j) == g.llama.generate([p], max_gen_len=15 - len(p), temperature=0)[0][0]


def test_more_inputs_than_cache_rows_queue_for_one(built):
    ref, d, g, prompts = built
    four = [p[:5] for p in prompts] + [prompts[0][5:10]]
    steps = list(g.generate([LLMInput(p) for p in four], temperature=0, max_gen_len=2))
    assert len(steps) == 2 and all(len(s) == 4 for s in steps)
    assert [outputs(steps, j) for j in range(4)] == g.llama.generate(four, max_gen_len=2, temperature=0)[0]


def test_echo_and_logprobs_are_metas_shape_and_the_facades_values(built):
    ref, d, g, prompts = built
    steps = list(g.generate([LLMInput(torch.tensor(p)) for p in prompts[1:]], temperature=0, max_gen_len=2,
                            logprobs=True, echo=True))
    echoed, out = steps[:9], steps[9:]
    assert all(r.source == "input" and r.logprobs == [0.0] for s in echoed for r in s)
    assert [s[0].token for s in echoed] == prompts[1] + [g.tokenizer.pad_id] * 2
    assert [s[0].ignore_token for s in echoed] == [False] * 7 + [True] * 2
    assert len(out) == 9 + 2 - 7
    for j, p in enumerate(prompts[1:]):
        toks, lps = g.llama.generate([p], max_gen_len=11 - len(p), temperature=0, logprobs=True, echo=True)
        mine = [(r.token, r.logprobs[0]) for s in out for r in s if r.batch_idx == j]
        want = list(zip(toks[0][7:], lps[0][7:]))  # from position 7 on: the prompt's then the generated
        assert [t for t, _ in mine] == [t for t, _ in want]
        torch.testing.assert_close([lp for _, lp in mine], [lp for _, lp in want], rtol=0, atol=1e-5)


def test_a_logits_processor_gets_metas_arguments_and_can_end_an_item(built):
    """Meta's logits_processor(tokens (1, cur_pos), logits): here one that forces <|eot|> once item 1 has two
    tokens. That item's step shows the stop token, finished; afterwards it is padding, finished and ignored, while
    item 0 runs on to max_gen_len."""
    ref, d, g, prompts = built
    eot, seen = g.tokenizer.special_tokens["<|eot|>"], []

    def force_eot(tokens, logits):
        seen.append(tokens[0].tolist())
        if tokens.shape[1] == len(prompts[1]) + 2:
            logits = torch.full_like(logits, float("-inf"))
            logits[..., eot] = 0.0
        return logits

    steps = list(g.generate([LLMInput(prompts[0]), LLMInput(prompts[1])], temperature=0, max_gen_len=4,
                            logits_processor=force_eot))
    item = [s[1] for s in steps]
    assert [r.finished for r in item] == [False, False, True] + [True] * (len(steps) - 3)
    assert item[2].token == eot and item[2].text == "<|eot|>" and not item[2].ignore_token
    assert all(r.ignore_token and r.token == g.tokenizer.pad_id for r in item[3:])
    assert outputs(steps, 0) == g.llama.generate([prompts[0]], max_gen_len=4, temperature=0)[0][0]
    assert prompts[1] + outputs(steps, 1)[:2] in seen and all(len(t) >= 7 for t in seen)


def test_completion_and_chat_completion_are_metas_greedy_and_the_facades(built):
    from llama_models.llama4.tokenizer import Tokenizer as MetaTokenizer

    ref, d, g, prompts = built
    text = "Once upon a time"
    meta_tokens = MetaTokenizer(Path(generation.tokenizer_path(d))).encode(text, bos=True, eos=False)
    steps = list(g.completion([text], temperature=0, max_gen_len=3))
    assert outputs(steps, 0) == meta_greedy(ref, meta_tokens, 3)
    assert outputs(steps, 0) == g.llama.generate([meta_tokens], max_gen_len=3, temperature=0)[0][0]
    dialog = [{"role": "user", "content": "Hello"}]
    chat = g.formatter.encode_dialog_prompt(dialog).tokens
    steps = list(g.chat_completion([dialog], temperature=0, max_gen_len=3))
    assert outputs(steps, 0) == meta_greedy(ref, chat, 3)
    assert outputs(steps, 0) == g.llama.generate([chat], max_gen_len=3, temperature=0)[0][0]


def test_refusals_name_what_is_refused(built, tmp_path, monkeypatch):
    ref, d, g, prompts = built
    with pytest.raises(ValueError, match="quantization_mode='fp8_mixed'.*quantize= one of int8, int8-dynamic, int4"):
        Llama4.build(str(d), 64, 1, quantization_mode="fp8_mixed")
    with pytest.raises(FileNotFoundError, match="params.json not found: Llama4.build reads a Meta-layout"):
        Llama4.build(str(tmp_path), 64, 1)
    monkeypatch.setattr(generation, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"tokenizer.model does not exist, and llama-models' llama4/tokenizer"
                                                r".model is not there \(llama-models is not installed\)"):
        generation.tokenizer_path(tmp_path)
    monkeypatch.undo()
    shutil.copy(need(STORIES) / "tokenizer.model", tmp_path / "tokenizer.model")
    assert generation.tokenizer_path(tmp_path) == str(tmp_path / "tokenizer.model")  # the checkpoint's comes first
    with pytest.raises(ValueError, match="Llama4 needs Llama 4's tokenizer"):
        Llama4(SimpleNamespace(tokenizer=object()), g.args)
    cases = [(dict(llm_inputs=[LLMInput([1, 2], images=[torch.zeros(3, 4, 4)])]), ValueError,
              r"llm_inputs\[0\] has images: the Llama 4 image encoder"),
             (dict(llm_inputs=[]), ValueError, "llm_inputs must be a non-empty list of LLMInput"),
             (dict(llm_inputs=[[1, 2]]), TypeError, r"llm_inputs\[0\] must be an LLMInput"),
             (dict(llm_inputs=[LLMInput(torch.ones(2, 2, dtype=torch.long))]), ValueError, r"shape \(2, 2\)"),
             (dict(llm_inputs=[LLMInput([1] * 64)]), ValueError, "prompt 0 has 64 tokens; it must be shorter than"),
             (dict(llm_inputs=[LLMInput([1])], max_gen_len=-1), ValueError, "max_gen_len must be None or an integer"),
             (dict(llm_inputs=[LLMInput([1])], logits_processor=3), TypeError, "logits_processor must be callable")]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            g.generate(**kwargs)
    with pytest.raises(ValueError, match="content item 1 is a bytes, not text: image content is not supported"):
        g.completion([["a", b"\x89PNG"]])
    with pytest.raises(ValueError, match="contents must be a non-empty list"):
        g.completion("text")
    with pytest.raises(ValueError, match="messages_batch must be a non-empty list of dialogs"):
        g.chat_completion([])
