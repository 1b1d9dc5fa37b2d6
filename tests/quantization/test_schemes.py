"""The quantization scheme registry (llama/quantization/registry.py, built-ins in schemes.py): a scheme registered
from here, with no other file touched, is what Llama.build's quantize=, the memory check and the command lines
take; an unregistered name is refused naming the valid ones."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from llama import Llama
from llama.loading import memory
from llama.hub.demo import write_random_checkpoint
from llama.layers import LinearMethod, linear_layers
from llama.quantization import schemes
from llama.quantization.cli import quantize_checkpoint
from llama.quantization.schemes import QuantScheme
from llama.quantization.stored import Int8Stored


class Bf16Rounded(LinearMethod):
    """A test-only method: the weight rounded to bf16 (held at the model's dtype), multiplied by F.linear."""

    quantized = True

    def apply(self, layer, x):
        return F.linear(x, layer.weight.to(x.dtype))


@torch.no_grad()
def round_to_bf16(model, group_size):
    for layer in linear_layers(model):
        if not layer.method.quantized:
            layer.take(Bf16Rounded(), layer.weight.data.to(torch.bfloat16))
    return model


BF16_ROUNDED = QuantScheme("test-bf16-rounded", round_to_bf16, weight_bits=16, aliases=("test-bf16",))
# int4 under a new name with another default group size: the same arithmetic as quantize="int4", group_size=64
INT4_G64 = dataclasses.replace(schemes.INT4, name="test-int4-g64", aliases=(), group_size=64, storage=None)


@pytest.fixture
def registered():
    schemes.register(BF16_ROUNDED)
    schemes.register(INT4_G64)
    yield
    schemes.unregister(BF16_ROUNDED.name)
    schemes.unregister(INT4_G64.name)


def _build(stories_dir, **kwargs):
    return Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=64, max_batch_size=2,
                       compile=False, prefix_cache="off", **kwargs)


TOKENS = torch.tensor([[1, 403, 407, 261, 378, 8, 43], [1, 50, 51, 52, 53, 54, 55]])


def test_the_built_ins_are_registered():
    assert schemes.SCHEMES == ("int8", "int8-dynamic", "int4") == schemes.names()[:3]
    assert schemes.storable() == ("int8", "int4")
    assert schemes.get("int4") is schemes.INT4 and schemes.lookup(schemes.INT8) is schemes.INT8
    assert schemes.lookup(None) is None
    assert schemes.INT8_DYNAMIC.loads(schemes.INT8) and schemes.INT8.loads(schemes.INT8)
    assert not schemes.INT4.loads(schemes.INT8) and not schemes.INT8_DYNAMIC.loads(schemes.INT4)
    # the memory check's bytes, as they were before the registry: int8 n*k + 4n, int4 n*k/2 + 4 per group of 32
    assert memory.linear_bytes(64, 96, "int8", torch.float32, None) == 64 * 96 + 4 * 64
    assert memory.linear_bytes(64, 96, "int8-dynamic", torch.float32, None) == 64 * 96 + 4 * 64
    assert memory.linear_bytes(64, 96, "int4", torch.float32, None) == 64 * 96 // 2 + 4 * 64 * 3
    assert memory.linear_bytes(64, 96, "int4", torch.float32, 64) == 64 * 96 // 2 + 4 * 64 * 2
    assert memory.linear_bytes(64, 96, None, torch.bfloat16, None) == 64 * 96 * 2


def test_a_registered_scheme_builds_through_llama_build(stories_dir, registered):
    ref = _build(stories_dir)  # fp32
    got = _build(stories_dir, quantize="test-bf16")  # by its alias
    for mine, theirs in zip(linear_layers(got.model), linear_layers(ref.model)):
        assert isinstance(mine.method, Bf16Rounded)
        assert torch.equal(mine.weight, theirs.weight.to(torch.bfloat16).float())  # cast back to fp32 by loading
    expected = round_to_bf16(ref.model, None)(TOKENS, 0)  # the same arithmetic, applied by hand
    assert torch.equal(got.model(TOKENS, 0), expected)
    assert "test-bf16-rounded" in schemes.names() and "test-bf16" in schemes.choices()
    assert memory.linear_bytes(8, 32, BF16_ROUNDED, torch.float32, None) == 8 * 32 * 2


def test_a_scheme_reusing_int4_under_another_group_size_equals_int4_at_that_size(stories_dir, registered):
    got = _build(stories_dir, quantize="test-int4-g64")
    want = _build(stories_dir, quantize="int4", group_size=64)
    assert all(m.method.group_size == 64 for m in linear_layers(got.model))
    assert torch.equal(got.model(TOKENS, 0), want.model(TOKENS, 0))
    assert not torch.equal(got.model(TOKENS, 0), _build(stories_dir, quantize="int4").model(TOKENS, 0))
    schemes.unregister(INT4_G64.name)  # a QuantScheme is taken as it is, registered or not
    try:
        assert torch.equal(_build(stories_dir, quantize=INT4_G64).model(TOKENS, 0), want.model(TOKENS, 0))
    finally:
        schemes.register(INT4_G64)


def test_a_registered_storable_scheme_is_written_and_loaded_by_its_name(stories_dir, tmp_path):
    """int8's stored layout under a new name: `python -m llama.quantize` records the name, Llama.build loads it
    back as that scheme (weight-only int8), the logits of quantize="int8" at load."""
    stored_int8 = schemes.register(dataclasses.replace(schemes.INT8, name="test-int8-stored", storage=Int8Stored()))
    try:
        params = {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 64, "vocab_size": 512,
                  "norm_eps": 1e-5}
        ckpt = write_random_checkpoint(tmp_path / "ckpt", params, seed=3, std=0.05)
        quantize_checkpoint(ckpt, tmp_path / "q", "test-int8-stored", shards=2, progress=False)
        record = json.loads((tmp_path / "q" / "params.json").read_text())["quantization"]
        assert record == {"scheme": "test-int8-stored"}
        tok = str(stories_dir / "tokenizer.model")  # 512 pieces, as params' vocabulary
        logits = [Llama.build(str(d), tok, 32, 2, quantize=q, compile=False).model(TOKENS, 0)
                  for d, q in ((tmp_path / "q", None), (ckpt, "int8"))]
        assert torch.equal(logits[0], logits[1])
        with pytest.raises(ValueError, match="holds test-int8-stored weights .* quantize='int8' cannot be applied"):
            Llama.build(str(tmp_path / "q"), tok, 32, 2, quantize="int8")
    finally:
        schemes.unregister(stored_int8.name)


def test_unknown_names_are_refused_naming_the_valid_ones(stories_dir, registered):
    with pytest.raises(ValueError, match=r"quantize must be one of .*'test-bf16-rounded'.* got 'int3'"):
        _build(stories_dir, quantize="int3")
    with pytest.raises(ValueError, match="quantize must be one of"):
        schemes.get(8)
    with pytest.raises(ValueError, match="group_size applies to quantize='int4' or 'test-int4-g64' only"):
        _build(stories_dir, quantize="test-bf16", group_size=32)
    with pytest.raises(ValueError, match="already taken"):
        schemes.register(dataclasses.replace(BF16_ROUNDED, name="another", aliases=("int8",)))
    with pytest.raises(TypeError, match="takes a QuantScheme"):
        schemes.register("int8")
    with pytest.raises(ValueError, match="no quantization scheme is registered as 'nope'"):
        schemes.unregister("nope")


def test_an_unregistered_scheme_is_gone(stories_dir):
    schemes.register(BF16_ROUNDED)
    schemes.unregister(BF16_ROUNDED.name)
    assert "test-bf16" not in schemes.choices()
    with pytest.raises(ValueError, match=r"quantize must be one of \('int8', 'int8-dynamic', 'int4'\) or None, "
                                         r"got 'test-bf16'"):
        _build(stories_dir, quantize="test-bf16")


def test_bad_schemes_are_refused_at_construction():
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        QuantScheme("", round_to_bf16, weight_bits=16)
    with pytest.raises(TypeError, match="aliases must be a tuple"):
        QuantScheme("x", round_to_bf16, weight_bits=16, aliases="y")
    with pytest.raises(ValueError, match="weight_bits must be an integer >= 1"):
        QuantScheme("x", round_to_bf16, weight_bits=0)
    with pytest.raises(ValueError, match="group size must be one of"):
        dataclasses.replace(schemes.INT4, name="x", group_size=48)


def test_a_device_the_scheme_does_not_run_on_is_named():
    with pytest.raises(ValueError, match=r"quantize='int8-dynamic' runs on cpu only \(the model is on meta\): use "
                                         r"one of \('int8',\) there"):
        schemes.INT8_DYNAMIC.check_device("meta")
    schemes.INT8.check_device("meta")  # weight-only int8 runs anywhere


def test_command_lines_offer_the_registered_schemes(registered):
    from llama.cli.chat import parser
    from llama.quantization.cli import storable
    from llama.serve.__main__ import parse_args

    assert parser().parse_args(["--quantize", "test-bf16"]).quantize == "test-bf16"
    assert parse_args(["--quantize", "test-int4-g64"]).quantize == "test-int4-g64"
    with pytest.raises(ValueError, match=r"scheme must be one of \('int8', 'int4'\), got 'test-int4-g64'"):
        storable("test-int4-g64")  # registered, but not storable
