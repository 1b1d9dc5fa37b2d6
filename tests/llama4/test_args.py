"""llama.llama4.args (llama-models' llama4 args path): Meta's params.json read as llama-models' pydantic ModelArgs
reads it (fields, defaults, nested dicts, Scout's rope defaults, unknown keys ignored), each bad field refused
naming it, and the conversion to our ModelArgs the Meta-checkpoint loader's own."""

import dataclasses
import warnings

import pytest

from llama.formats import llama4
from llama.llama4.args import LoRAArgs, ModelArgs, MoEArgs, QuantizationArgs, QuantizationScheme, VisionArgs
from llama.model_args import ModelArgs as LlamaModelArgs
from llama4_reference import SHAPES

VISION = {"image_size": {"height": 336, "width": 336}, "patch_size": {"height": 14, "width": 14}, "dim": 8,
          "n_layers": 1, "n_heads": 2, "mlp_ratio": 4.0, "output_dim": 16, "pixel_shuffle_ratio": 0.5}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_fields_and_defaults_are_llama_models(name):
    pytest.importorskip("llama_models", reason="llama-models (Meta's reference code) is a test dependency")
    from llama_models.llama4.args import ModelArgs as MetaArgs

    params = {**SHAPES[name], "vision_args": VISION}
    ours, meta = ModelArgs(**params, max_seq_len=64, max_batch_size=2), MetaArgs(**params, max_seq_len=64,
                                                                               max_batch_size=2)
    assert [f.name for f in dataclasses.fields(ours)] == list(type(meta).model_fields)
    assert ours.params() == meta.model_dump(mode="json", exclude_none=True)
    assert isinstance(ours.moe_args, MoEArgs) and isinstance(ours.vision_args, VisionArgs)
    assert ours.vision_args.image_size.height == 336
    defaults = {k: v for k, v in MetaArgs.model_construct().model_dump().items()}
    assert {f.name: f.default for f in dataclasses.fields(ours)} == defaults
    assert dataclasses.asdict(MoEArgs()) == type(meta.moe_args)().model_dump()


def test_to_model_args_is_the_loaders_conversion():
    params = SHAPES["scout"]
    ours = ModelArgs(**params, max_seq_len=64, max_batch_size=2)
    assert (ours.rope_scaling_factor, ours.rope_high_freq_factor) == (16, 1)  # Meta's Scout defaults
    want = LlamaModelArgs(**llama4.meta_params({**params, "max_seq_len": 64, "max_batch_size": 2}, "params.json"))
    assert ours.to_model_args() == want
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelArgs(**params, vision_args=VISION).to_model_args()
    assert any("image encoder" in str(w.message) for w in caught)


def test_unknown_keys_are_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="rope_type is not a field of Meta's Llama 4 ModelArgs; ignored"):
        args = ModelArgs(**SHAPES["maverick"], rope_type="x")
    assert not hasattr(args, "rope_type")


@pytest.mark.parametrize("change,error,message", [
    ({"dim": "64"}, TypeError, r"ModelArgs.dim must be an integer, got '64'"),
    ({"use_qk_norm": 1}, TypeError, r"ModelArgs.use_qk_norm must be true or false, got 1"),
    ({"rope_theta": float("nan")}, TypeError, r"ModelArgs.rope_theta must be a finite number"),
    ({"n_layers": -1}, ValueError, r"ModelArgs.n_layers must be a positive integer, got -1"),
    ({"n_kv_heads": 3}, ValueError, r"ModelArgs.n_kv_heads \(3\) must divide n_heads \(4\)"),
    ({"dim": 66}, ValueError, r"ModelArgs.dim \(66\) must be divisible by n_heads \(4\)"),
    ({"moe_args": {"num_experts": 4, "group_size": 2}}, ValueError,
     r"ModelArgs.moe_args has unknown key\(s\) group_size \(known: num_experts, capacity_factor"),
    ({"moe_args": {"top_k": 1.5}}, TypeError, r"MoEArgs.top_k must be an integer, got 1.5"),
    ({"moe_args": [4]}, TypeError, r"ModelArgs.moe_args must be a dict or a MoEArgs, got list"),
    ({"vision_args": {"dim": 8}}, ValueError, r"ModelArgs.vision_args lacks image_size, patch_size, n_layers"),
    ({"quantization_args": {"scheme": "fp8"}}, ValueError, r"QuantizationArgs.scheme must be one of"),
    ({"lora_args": {"rank": 8, "scale": "x"}}, TypeError, r"LoRAArgs.scale must be a finite number"),
])
def test_bad_fields_are_refused_naming_them(change, error, message):
    with pytest.raises(error, match=message):
        ModelArgs(**{**SHAPES["scout"], **change})


@pytest.mark.parametrize("change,message", [
    ({"moe_args": None}, r"ModelArgs.moe_args is None: the Llama 4 text model here has experts"),
    ({"quantization_args": QuantizationArgs(QuantizationScheme.int4_weight_int8_dynamic_activation, 64)},
     r"ModelArgs.quantization_args: Meta's quantized Llama 4 weights are not read here.*quantize="),
    ({"lora_args": LoRAArgs(rank=8, scale=2.0)}, r"ModelArgs.lora_args: LoRA adapters are not merged here"),
    ({"ffn_exp": None}, r"a Llama 4 params.json needs ffn_exp and ffn_dim_multiplier"),
])
def test_what_the_model_cannot_compute_is_refused_on_conversion(change, message):
    args = ModelArgs(**{**SHAPES["scout"], **change})
    with pytest.raises(ValueError, match=message):
        args.to_model_args()
