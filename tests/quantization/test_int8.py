"""int8 quantization, weight-only ("int8") and with dynamic int8 activations ("int8-dynamic"): the scheme's error
bound, every linear layer converted, the products against dequantized references, agreement with fp32 on
stories260K, batch == solo, Meta names kept, and model parallel (each rank quantizes its shard) under torchrun."""

import textwrap

import hardware
import pytest
import torch
from conftest import CPU_ONLY, run_two_ranks
from test_model import random_model

from llama import Llama
from llama.kernels import cpu
from llama.model import ColumnLinear, RowLinear
from llama.quantization.int8 import (
    ACT_HALF_RANGE,
    ACT_ZERO_POINT,
    Int8Dynamic,
    Int8DynamicOneDNN,
    Int8WeightOnly,
    dequantize_weight,
    dynamic_int8_linear,
    quantize_rows,
    quantize_weight,
)
from llama.quantization.schemes import quantize_int8, quantize_int8_dynamic


def test_quantize_weight_error_is_half_a_step():
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different magnitude
    w[5] = 0.0
    q, scales = quantize_weight(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16 and scales.shape == (48,)
    err = (dequantize_weight(q, scales) - w).abs()
    assert torch.all(err <= scales.float()[:, None] / 2 + 1e-12)
    assert torch.all(dequantize_weight(q, scales)[5] == 0)
    assert q.abs().max() <= 127


def test_every_linear_layer_is_quantized_and_logits_stay_close():
    model = random_model(dtype=torch.bfloat16).fuse()
    tokens = torch.randint(0, 96, (2, 6))
    ref = model(tokens, 0)
    quantize_int8(model)
    linears = [m for m in model.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    assert len(linears) == 2 * 4 + 1  # per layer wqkv, wo, w13, w2; plus the output
    assert all(isinstance(m.method, Int8WeightOnly) and m.weight.dtype == torch.int8
               and m.scales.dtype == torch.bfloat16 for m in linears)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    got = model(tokens, 0)
    assert (got - ref).abs().mean() < 0.08 * ref.abs().mean()  # a random, chaotic model: 0.034 measured
    state = model.state_dict()  # Meta's names, plus a scales tensor per linear layer
    assert state["layers.0.attention.wq.weight"].dtype == torch.int8
    assert state["layers.0.attention.wk.scales"].shape == (ModelArgsLike.kv_dim,)


class ModelArgsLike:
    kv_dim = 2 * (64 // 4)  # n_kv_heads * head_dim of test_model's random model


def test_build_int8_follows_fp32_greedy_on_stories(stories_dir, goldens):
    """Measured: the prompts' greedy ids match fp32 for their first 102 and 114 tokens; asserted with margin."""
    llama = Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=256, max_batch_size=2,
                        quantize="int8")
    assert llama.model.norm.weight.dtype == torch.bfloat16  # int8 implies bf16 activations by default
    assert llama.model.output.weight.dtype == torch.int8
    prompts = [g["prompt_tokens"] for g in goldens.values()]
    out, _ = llama.generate(prompts, max_gen_len=128, temperature=0)
    for got, g in zip(out, goldens.values()):
        assert got[:48] == g["generated_tokens"][:48]


def test_bad_quantize_argument(stories_dir):
    with pytest.raises(ValueError, match="quantize must be one of"):
        Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), 64, 1, quantize="int3")


SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from llama.generation import Llama

    ckpt, tokenizer, goldens, out, *schemes = sys.argv[1:]
    prompts = [g["prompt_tokens"] for g in json.load(open(goldens)).values()]
    result = {}
    for scheme in schemes:
        llama = Llama.build(ckpt, tokenizer, max_seq_len=160, max_batch_size=2, device="cpu", quantize=scheme)
        attn = llama.model.layers[0].attention
        greedy, _ = llama.generate(prompts, max_gen_len=64, temperature=0.0)
        result[scheme] = {"greedy": greedy, "wqkv_rows": attn.wqkv.scales.shape[0],
                          "int8": attn.wo.packed is not None or attn.wo.weight.dtype == torch.int8}
    with open(f"{out}.{os.environ['RANK']}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
""")


SCHEMES = {"int8": 32, "int8-dynamic": 32}  # greedy ids that must agree with fp32: 102/114 and 57/79 alone


@pytest.fixture(scope="module")
def mp_ranks(tmp_path_factory):
    """One torchrun launch for both schemes (each rank builds one model per scheme): {scheme: the ranks' json}."""
    ranks = run_two_ranks(tmp_path_factory.mktemp("int8_mp"), SCRIPT, *SCHEMES, timeout=400)
    return {scheme: [r[scheme] for r in ranks] for scheme in SCHEMES}


@pytest.mark.parametrize("scheme, agree", list(SCHEMES.items()))
def test_int8_under_model_parallel(goldens, mp_ranks, scheme, agree):
    """Two ranks, each quantizing its own shard of a 2-shard checkpoint, follow the fp32 goldens."""
    ranks = mp_ranks[scheme]
    assert ranks[0]["greedy"] == ranks[1]["greedy"]
    assert ranks[0]["int8"]
    assert ranks[0]["wqkv_rows"] == (8 + 4 + 4) * 8 // 2  # this rank's q, k, v heads only
    for got, g in zip(ranks[0]["greedy"], goldens.values()):
        assert got[:agree] == g["generated_tokens"][:agree]


# ------------------------------------------------------------------------------------------------- int8-dynamic
def test_quantize_rows_round_trip():
    x = torch.randn(5, 40) * torch.logspace(-4, 2, 5)[:, None]
    x[2] = 0.0
    codes, scales = quantize_rows(x)
    assert codes.dtype == torch.uint8 and scales.shape == (5, 1)
    zp = ACT_ZERO_POINT
    assert codes.min() >= zp - ACT_HALF_RANGE and codes.max() <= zp + ACT_HALF_RANGE and torch.all(codes[2] == zp)
    back = (codes.float() - zp) * scales
    assert torch.all((back - x).abs() <= scales / 2 * (1 + 1e-5))


@pytest.mark.parametrize("k", [64, 40])  # 40: not a multiple of oneDNN's VNNI block of 4
def test_dynamic_int8_linear_is_the_exact_integer_product(k):
    """The product equals the dequantized rows times the dequantized weight (up to fp32 rounding), and a row's
    result does not depend on the other rows of its batch: integer accumulation is exact."""
    x = torch.randn(6, k)
    q, scales = quantize_weight(torch.randn(24, k), torch.float32)
    packed = torch.ops.onednn.qlinear_prepack(q, None)
    zp = torch.zeros(24, dtype=torch.int64)
    got = dynamic_int8_linear(x.view(2, 3, k), packed, scales, zp)
    codes, row_scales = quantize_rows(x)
    want = ((codes.float() - ACT_ZERO_POINT) * row_scales) @ dequantize_weight(q, scales).T
    assert got.shape == (2, 3, 24) and got.dtype == torch.float32
    torch.testing.assert_close(got.view(6, 24), want, rtol=1e-5, atol=1e-5)
    for i in range(6):
        assert torch.equal(dynamic_int8_linear(x[i : i + 1], packed, scales, zp), got.view(6, 24)[i : i + 1])


def test_int8_dynamic_replaces_every_weight():
    model = random_model().fuse()
    tokens = torch.randint(0, 96, (2, 6))
    ref = model(tokens, 0)
    quantize_int8_dynamic(model)
    linears = [m for m in model.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    assert len(linears) == 2 * 4 + 1
    for m in linears:  # our kernel's plain int8 codes where the input size allows, else oneDNN's packed copy
        if isinstance(m.method, Int8Dynamic):
            assert m.weight.dtype == torch.int8 and m.packed is None and m.weight.shape[1] % 32 == 0
        else:
            assert isinstance(m.method, Int8DynamicOneDNN) and m.weight is None and m.packed is not None
        assert m.scales.dtype == torch.float32
    assert any(isinstance(m.method, Int8Dynamic) for m in linears) == cpu.available()
    got = model(tokens, 0)
    assert (got - ref).abs().mean() < 0.08 * ref.abs().mean()
    quantize_int8_dynamic(model)  # a second call leaves the layers alone
    assert torch.equal(model(tokens, 0), got)


def test_int8_dynamic_refuses_a_non_cpu_model():
    with torch.device("meta"):
        model = random_model()
    with pytest.raises(ValueError, match="int8-dynamic.*needs a CPU"):
        quantize_int8_dynamic(model)


@CPU_ONLY
def test_build_int8_dynamic_follows_fp32_and_batch_equals_solo(stories_dir, goldens):
    """Teacher-forced on the goldens' sequences, against fp32. Measured argmax agreement / logit error: our kernel
    (blocks of 32, 8 bits) 0.962 / 0.0199 and 0.979 / 0.0184; oneDNN without VNNI (7-bit rows) 0.970 / 0.0267 and
    0.979 / 0.0202. Greedy ids then agree with the goldens for their first 16 and 59 tokens (ours), 35 and 51
    (oneDNN, 7 bits), 57 and 79 (oneDNN with VNNI): a tiny model is chaotic, so the floor asserted is low."""
    llama = Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=256, max_batch_size=2,
                        quantize="int8-dynamic")
    assert llama.model.norm.weight.dtype == torch.float32  # activations keep the device default
    fp32 = Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=256, max_batch_size=2)
    for g in goldens.values():
        tokens = torch.tensor([g["prompt_tokens"] + g["generated_tokens"]])
        got, ref = llama.model(tokens, 0)[0].float(), fp32.model(tokens, 0)[0].float()
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
        assert (got - ref).norm() / ref.norm() < 0.03
    prompts = [g["prompt_tokens"] for g in goldens.values()]
    out, _ = llama.generate(prompts, max_gen_len=128, temperature=0)
    for got, g in zip(out, goldens.values()):
        assert got[:12] == g["generated_tokens"][:12]
    assert [llama.generate([p], max_gen_len=128, temperature=0)[0][0] for p in prompts] == out


# ------------------------------------------------------------------------------------------- stored checkpoints
STORED = textwrap.dedent("""
    import sys
    import torch
    from llama import Llama

    ckpt, tok, quantize, out = sys.argv[1:]
    llama = Llama.build(ckpt, tok, 32, 2, quantize=None if quantize == "none" else quantize, compile=False)
    tokens = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = llama.model(tokens.to(llama.model.norm.weight.device), 0).cpu()
    torch.save({"method": type(llama.model.layers[0].attention.wqkv.method).__name__,
                "output": type(llama.model.output.method).__name__, "logits": logits}, out)
""")


@pytest.fixture(scope="module")
def stored_int8(tmp_path_factory):
    """A random checkpoint (dims multiples of 32) written by `python -m llama.quantize --scheme int8`."""
    from conftest import STORIES, need

    from llama.hub.demo import write_random_checkpoint
    from llama.quantization.cli import quantize_checkpoint

    d = tmp_path_factory.mktemp("stored")
    params = {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 64, "vocab_size": 512}
    src = write_random_checkpoint(d / "float", params, seed=3, std=0.05)
    quantize_checkpoint(src, d / "int8", "int8", progress=False)
    return d / "int8", str(need(STORIES / "tokenizer.model"))


def _stored(tmp_path, ckpt, tok, quantize, **env):
    """(wqkv's method name, output's method name, logits) of a build in a fresh process (the kernels' switch is
    read once per process)."""
    import os
    import subprocess
    import sys

    from conftest import REPO, error_lines

    script, out = tmp_path / "stored.py", tmp_path / f"{quantize}.pt"
    script.write_text(STORED)
    proc = subprocess.run([sys.executable, str(script), str(ckpt), tok, quantize, str(out)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get(
                              "PYTHONPATH")])), **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, error_lines(proc.stderr)
    got = torch.load(out)
    return got["method"], got["output"], got["logits"]


@hardware.KERNELS
def test_a_stored_int8_checkpoint_loads_as_int8_dynamic_by_default(stored_int8):
    """With no quantize=, stored int8 weights run the fastest int8 kernel (our int8-dynamic one), bitwise an
    explicit quantize="int8-dynamic" build; quantize="int8" still means weight-only."""
    from llama.quantization.int8 import Int8Dynamic

    ckpt, tok = stored_int8
    plain = Llama.build(str(ckpt), tok, 32, 2, compile=False).model
    linears = [m for m in plain.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    if plain.norm.weight.device.type != "cpu":  # our kernels are CPU kernels: on a GPU the fastest is weight-only
        assert all(isinstance(m.method, Int8WeightOnly) for m in linears)
        return
    tokens = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    assert all(isinstance(m.method, Int8Dynamic) for m in plain.modules() if isinstance(m, (ColumnLinear, RowLinear)))
    assert plain.norm.weight.dtype == torch.float32  # int8-dynamic's activations, not weight-only's bf16
    explicit = Llama.build(str(ckpt), tok, 32, 2, quantize="int8-dynamic", compile=False).model
    assert torch.equal(plain(tokens, 0), explicit(tokens, 0))
    weight_only = Llama.build(str(ckpt), tok, 32, 2, quantize="int8", compile=False).model
    assert isinstance(weight_only.output.method, Int8WeightOnly) and weight_only.norm.weight.dtype == torch.bfloat16


def test_a_stored_int8_checkpoint_stays_weight_only_without_our_kernels(stored_int8, tmp_path):
    """LLAMA_CPU_KERNELS=0 (as on a CPU without AVX2): weight-only int8, as before, whether asked for or not."""
    ckpt, tok = stored_int8
    plain = _stored(tmp_path, ckpt, tok, "none", LLAMA_CPU_KERNELS="0")
    assert plain[:2] == ("Int8WeightOnly", "Int8WeightOnly")
    explicit = _stored(tmp_path, ckpt, tok, "int8", LLAMA_CPU_KERNELS="0")
    assert explicit[:2] == plain[:2] and torch.equal(explicit[2], plain[2])


def test_linear_layers_hold_their_method_and_the_model_imports_no_quantization():
    """A layer's scheme is the method it holds (set by quantization, never inferred from tensor shapes), and
    llama/model.py and llama/layers.py know nothing of the quantization package."""
    import ast
    from pathlib import Path

    import llama.layers
    import llama.model
    from llama.layers import Unquantized

    for module in (llama.model, llama.layers):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.startswith("llama.quantization")], module.__name__
    model = random_model().fuse()
    linears = [m for m in model.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    assert all(isinstance(m.method, Unquantized) for m in linears)
    quantize_int8(model)
    assert all(isinstance(m.method, Int8WeightOnly) for m in linears)
