"""llama.llama4.model (llama-models' llama4 model path): Transformer(ModelArgs) is our transformer, loads Meta's
state dict (its model's, and one consolidated file in Meta's layout) and, called with a TransformerInput, gives
Meta's reference's fp32 logits (tests/llama4_reference.py, on the Scout and Maverick shapes): a prefill, then a
one-token step at tokens_position over the KV cache it keeps. Its precompute_freqs_cis is Meta's table, and every
bad input is refused naming it."""

import pytest
import torch

from llama.llama4.args import ModelArgs
from llama.llama4.datatypes import MaskedEmbedding, TransformerInput, TransformerOutput
from llama.llama4.model import Transformer, precompute_freqs_cis
from llama.model import Transformer as LlamaTransformer
from llama4_reference import SHAPES, meta_files, meta_reference

llama_models = pytest.importorskip("llama_models", reason="llama-models (Meta's reference code) is a test dependency")

_BUILT: dict = {}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request):
    """(name, Meta's reference with random weights, ours with them loaded from its state dict, a prompt)."""
    name = request.param
    if name not in _BUILT:
        ref = meta_reference(SHAPES[name], seed=3, max_batch_size=2)
        ours = Transformer(ModelArgs(**SHAPES[name], max_seq_len=128, max_batch_size=2))
        assert not ours.load_state_dict(ref.state_dict()).missing_keys
        prompt = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(4))
        _BUILT[name] = name, ref, ours, prompt
    return _BUILT[name]


def meta(ref, tokens, position):
    from llama_models.llama4.datatypes import TransformerInput as MetaInput

    with torch.no_grad():
        return ref(MetaInput(tokens=tokens, tokens_position=position)).logits


def test_prefill_logits_equal_metas(pair):
    name, ref, ours, prompt = pair
    assert isinstance(ours, LlamaTransformer) and ours.args.moe_args is not None
    out = ours.forward(TransformerInput(tokens=prompt, tokens_position=0))
    assert isinstance(out, TransformerOutput) and out.logits.dtype == torch.float32 and out.logits.shape == (2, 20, 512)
    torch.testing.assert_close(out.logits, meta(ref, prompt, 0), rtol=0, atol=2e-5)


def test_a_decode_step_over_the_kept_cache_equals_metas(pair):
    """Prefill 10 positions, then one token at tokens_position 10 (inside the first chunk of 16, where Meta's
    maskless decode step attends as its prefill does)."""
    name, ref, ours, prompt = pair
    first = ours(TransformerInput(tokens=prompt[:, :10], tokens_position=0)).logits
    step = ours(TransformerInput(tokens=prompt[:, 10:11], tokens_position=10)).logits
    torch.testing.assert_close(first, meta(ref, prompt[:, :10], 0), rtol=0, atol=2e-5)
    torch.testing.assert_close(step, meta(ref, prompt[:, 10:11], 10), rtol=0, atol=2e-5)
    rows = ours(TransformerInput(tokens=prompt[:, 10:11], tokens_position=torch.tensor([10, 10]))).logits
    torch.testing.assert_close(rows, step, rtol=0, atol=1e-6)  # one start per row: the same step


def test_a_consolidated_file_in_metas_layout_loads(pair):
    name, ref, ours, prompt = pair
    other = Transformer(ModelArgs(**SHAPES[name], max_seq_len=32, max_batch_size=1))
    shard = meta_files(ref.state_dict(), SHAPES[name], 1)[0]
    assert any(k.endswith("moe_w_in_eD_F") for k in shard) and any(k.endswith("wqkv.weight") for k in shard)
    assert not other.load_state_dict({**shard, "rope.freqs": torch.zeros(8)}).missing_keys
    torch.testing.assert_close(other(TransformerInput(prompt[:1], 0)).logits, meta(ref, prompt[:1], 0), rtol=0,
                               atol=2e-5)


@pytest.mark.parametrize("args", [(16, 300, 500000.0, True, 16.0, 1.0), (16, 300, 500000.0, False, None, None),
                                  (128, 40, 10000.0, True, 8.0, 4.0)])
def test_precompute_freqs_cis_is_metas(args):
    from llama_models.llama4.model import precompute_freqs_cis as metas

    assert torch.equal(precompute_freqs_cis(*args), metas(*args))


def test_bad_inputs_are_refused_naming_them(pair):
    name, ref, ours, prompt = pair
    image = MaskedEmbedding(embedding=torch.zeros(1, 4, 64), mask=torch.zeros(1, 4, 1, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="image_embedding: the Llama 4 image encoder .* is not implemented"):
        ours(TransformerInput(prompt[:1, :4], 0, image_embedding=image))
    cases = [(TransformerInput(prompt[0], 0), TypeError, r"tokens must be an integer tensor \(batch, seqlen\)"),
             (TransformerInput(prompt.float(), 0), TypeError, "tokens must be an integer tensor"),
             (TransformerInput(prompt[:, :0], 0), ValueError, r"tokens has shape \(2, 0\)"),
             (TransformerInput(torch.zeros(3, 2, dtype=torch.long), 0), ValueError, r"1 to max_batch_size \(2\)"),
             (TransformerInput(prompt, 120), ValueError, r"positions 120..139 must lie in 0..max_seq_len - 1 \(127\)"),
             (TransformerInput(prompt, -1), ValueError, "positions -1..18"),
             (TransformerInput(prompt, 1.0), TypeError, "tokens_position must be an int or a"),
             (TransformerInput(prompt, torch.tensor([0])), ValueError, r"one integer start per row, shape \(2,\)")]
    for inp, error, message in cases:
        with pytest.raises(error, match=message):
            ours(inp)
    with pytest.raises(TypeError, match="args must be llama.llama4.args.ModelArgs"):
        Transformer(ours.params)
