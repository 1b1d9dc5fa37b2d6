"""The model's hyperparameters (llama/model_args.py): an MoE FFN's arguments (MoEArgs) are checked when built, each
refusal naming the argument and its limit, and which layers are MoE layers follows Qwen3-MoE's rule."""

import pytest

from llama.model_args import ModelArgs, MoEArgs, check_model_parallel

SHAPE = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=96)
MOE = dict(n_experts=4, top_k=2, hidden_dim=32)


@pytest.mark.parametrize("change,message", [
    ({"n_experts": 0}, r"MoE argument n_experts must be a positive integer, got 0"),
    ({"top_k": True}, r"MoE argument top_k must be a positive integer, got True"),
    ({"hidden_dim": 8.0}, r"MoE argument hidden_dim must be a positive integer, got 8.0"),
    ({"every": -1}, r"MoE argument every must be a positive integer, got -1"),
    ({"top_k": 5}, r"MoE top_k \(5\) must be at most n_experts \(4\)"),
    ({"renormalize": 1}, r"MoE renormalize must be true or false, got 1"),
    ({"router": "relu"}, r"MoE router 'relu' is not supported \(supported: softmax, sigmoid\)"),
    ({"dense_layers": [0, -1]}, r"MoE dense_layers must be a list of layer indices, got \[0, -1\]"),
    ({"dense_layers": 3}, r"MoE dense_layers must be a list of layer indices, got 3"),
])
def test_moe_arguments_out_of_range_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        MoEArgs(**{**MOE, **change})
    with pytest.raises(ValueError, match=message):  # params.json's dict, through ModelArgs
        ModelArgs(**SHAPE, moe={**MOE, **change})


def test_a_moe_dict_with_unknown_keys_or_of_another_type_is_refused():
    with pytest.raises(ValueError, match=r"moe has unknown keys experts, k \(known: dense_layers, every, hidden_dim, "
                                         r"n_experts, renormalize, router, scale_inputs, shared_expert, top_k\)"):
        ModelArgs(**SHAPE, moe={"experts": 4, "k": 2, "hidden_dim": 32})
    with pytest.raises(ValueError, match=r"moe: .*missing 1 required positional argument: 'hidden_dim'"):
        ModelArgs(**SHAPE, moe={"n_experts": 4, "top_k": 2})
    with pytest.raises(ValueError, match=r"moe must be a dict of MoE arguments, got list"):
        ModelArgs(**SHAPE, moe=[4, 2, 32])


def test_moe_layers_follow_every_and_dense_layers():
    args = ModelArgs(**SHAPE, moe={**MOE, "every": 2, "dense_layers": [3, 3]})
    assert args.moe.dense_layers == (3,)
    assert [args.moe.is_moe(i) for i in range(4)] == [False, True, False, False]
    assert ModelArgs(**SHAPE, moe=MoEArgs(**MOE)).moe == MoEArgs(**MOE)
    assert ModelArgs(**SHAPE, moe=MOE, qk_norm=True).kernel_decodes(8)  # the one-call step takes experts and qk-norm


def test_model_parallel_must_divide_the_experts_hidden_size():
    check_model_parallel(ModelArgs(**SHAPE, moe=MOE), 2)
    with pytest.raises(ValueError, match=r"model parallel size 2 does not divide expert hidden dim \(33\)"):
        check_model_parallel(ModelArgs(**SHAPE, moe={**MOE, "hidden_dim": 33}), 2)
    with pytest.raises(ValueError, match=r"qk_norm must be true or false, got 'yes'"):
        ModelArgs(**SHAPE, qk_norm="yes")
