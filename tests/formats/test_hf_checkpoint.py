"""Hugging Face directories of the LLaMA-style families (tests/families.py: Llama, Mistral with a sliding window,
Qwen2 with q/k/v biases and tied embeddings, Phi-3 with fused tensors and long-rope, Granite's multipliers, YaRN,
Qwen3's qk-norm, the mixture-of-experts Qwen3-MoE (with a dense layer among the MoE ones) and Mixtral),
written by transformers with random weights: our logits within 1e-4 of transformers' over 300 positions, and the
same greedy ids alone, batched and through the engine."""

import json

import pytest
import torch
from families import FAMILIES, HF_ONLY, hf_greedy, our_logits, sentencepiece_model, sequence, write_hf

from llama import Llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")


@pytest.fixture(scope="module")
def sp_model():
    return sentencepiece_model()


@pytest.fixture(scope="module")
def family(sp_model, tmp_path_factory):
    """family(name) -> (directory, transformers model, our generator), built once per module."""
    built = {}

    def get(name):
        if name not in built:
            d, model = write_hf(name, tmp_path_factory.mktemp(name) / "hf", sp_model)
            g = Llama.build(str(d), None, max_seq_len=320, max_batch_size=3, compile=False, dtype=torch.float32)
            built[name] = (d, model, g)
        return built[name]

    return get



def ref_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


@pytest.mark.parametrize("name", [*FAMILIES, *HF_ONLY])
def test_logits_match_transformers_over_300_positions(family, name):
    _, model, g = family(name)
    seq = sequence(300)
    ref = ref_logits(model, seq)
    assert (our_logits(g, seq) - ref).abs().max() < 1e-4 * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("name", [*FAMILIES, *HF_ONLY])
def test_greedy_ids_alone_batched_and_through_the_engine(family, name):
    """Prompts longer than twice Mistral's window of 24, so decoding attends past it. Long-rope's factors are
    chosen once from max_seq_len (transformers chooses per forward pass, by its length): within the original
    context of 128 both use the short ones."""
    d, model, g = family(name)
    if name == "phi3-longrope":
        g = Llama.build(str(d), None, max_seq_len=128, max_batch_size=3, compile=False, dtype=torch.float32)
    prompts = [sequence(60, seed=2), sequence(75, seed=3), sequence(9, seed=4)]
    want = [hf_greedy(model, p, 20) for p in prompts]
    assert [g.generate([p], max_gen_len=20, temperature=0)[0][0] for p in prompts] == want
    assert g.generate(prompts, max_gen_len=20, temperature=0)[0] == want
    with g.engine(prefill_chunk=16) as engine:
        requests = [engine.submit(p, max_gen_len=20, temperature=0) for p in prompts]
        for r in requests:
            r.result(timeout=120)
    assert [r.generated for r in requests] == want


def test_the_window_changes_the_reference_s_logits(family):
    """The reference is not blind to what the tests prove: transformers without Mistral's window gives other
    logits past it."""
    d, model, _ = family("mistral")
    seq = sequence(100)
    unwindowed = transformers.AutoModelForCausalLM.from_pretrained(d, sliding_window=None, dtype=torch.float32)
    assert (ref_logits(unwindowed, seq) - ref_logits(model, seq)).abs().max() > 1e-2


def test_a_sharded_directory_and_the_converted_meta_layout_load_the_same(sp_model, tmp_path):
    """save_pretrained's sharded safetensors with their index, and `python -m llama.convert hf` (params.json naming
    the family's fields), give the same logits as transformers."""
    from llama.cli.convert import main

    d, model = write_hf("qwen2", tmp_path / "hf", sp_model, max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").is_file()
    seq = sequence(50)
    ref = ref_logits(model, seq)
    g = Llama.build(str(d), None, max_seq_len=64, max_batch_size=1, compile=False, dtype=torch.float32)
    assert (our_logits(g, seq) - ref).abs().max() < 1e-4
    assert main(["hf", str(d), str(tmp_path / "meta")]) == 0
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert params["qkv_bias"] is True
    g = Llama.build(str(tmp_path / "meta"), str(tmp_path / "meta" / "tokenizer.model"), max_seq_len=64,
                    max_batch_size=1, compile=False, dtype=torch.float32)
    assert (our_logits(g, seq) - ref).abs().max() < 1e-4


def test_unknown_architectures_and_features_are_refused_by_name(sp_model, tmp_path):
    d, _ = write_hf("llama", tmp_path / "hf", sp_model)
    config = json.loads((d / "config.json").read_text())
    for change, words in (({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"},
                           "'GemmaForCausalLM'] is not supported (supported: LlamaForCausalLM, MistralForCausalLM"),
                          ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
                          ({"attention_bias": True}, "attention_bias"), ({"hidden_act": "gelu"}, "gelu")):
        (d / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
            Llama.build(str(d), None, max_seq_len=32, max_batch_size=1)
