"""The compiled decode step (torch.compile: our CPU kernels on the model's own float weights where they run, else
max-autotune on frozen weights) gives the reference's greedy ids on stories260K in fp32, alone and under model
parallel (collectives inside the graph), and both int8 schemes compiled follow their eager selves.

Compiling costs seconds to tens of seconds per graph, so this module compiles few graphs; Inductor's on-disk
cache makes reruns faster. Skipped when there is no C++ compiler for Inductor's CPU backend.
"""

import io
import shutil
import textwrap

import hardware
import pytest
import torch
from conftest import CPU_ONLY

from llama import Llama
from llama.compilation import compiled_decode
from llama.compilation.compiled_decode import (
    CompiledDecode,
    bucket,
    compile_decode,
    own_storage,
)
from llama.core.worker.kv_cache import KVCache
from llama.quantization.schemes import quantize_int8, quantize_int8_dynamic

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="torch.compile's CPU backend needs a C++ compiler (g++/clang++) on PATH",
)


def build(stories_dir, **kw):
    return Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=160, max_batch_size=2,
                       **kw)


def test_compiled_greedy_matches_goldens(stories_dir, goldens, monkeypatch):
    """torch.compile's graph (the path of model parallel and LLAMA_COMPILE_CACHE=0). The stored step of this same
    build gives the goldens in test_step_store_kernels.py (kernel_cache); with the store on here, this test compiled
    that package a second time."""
    monkeypatch.setenv("LLAMA_COMPILE_CACHE", "0")
    llama = build(stories_dir, compile=True)
    assert not llama.runner.compiled.packages
    prompts = [g["prompt_tokens"] for g in goldens.values()]
    out, _ = llama.generate(prompts, max_gen_len=128, temperature=0)
    assert llama.runner.compiled.seen.keys() == {(2, False)}  # every decode step went through the graph
    for got, g in zip(out, goldens.values()):
        assert got == g["generated_tokens"]


@pytest.mark.parametrize("scheme", ["int8", pytest.param("int8-dynamic", marks=CPU_ONLY)])
def test_compiled_int8_follows_eager_int8_with_a_padded_batch(stories_dir, goldens, scheme):
    """Batch 3 in a cache of 4 rows runs as the batch-4 graph (padded with a copy of the last row)."""
    llama = Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=160, max_batch_size=4,
                        quantize=scheme)
    dev = llama.device
    prompts = torch.tensor([g["prompt_tokens"][:5] for g in goldens.values()] + [[1, 300, 301, 302, 303]], device=dev)
    model = llama.model
    model(prompts, 0)
    nxt = torch.tensor([[300], [301], [302]], device=dev)
    pos = torch.tensor([5, 5, 4], device=dev)
    eager = model(nxt, pos)
    step = compile_decode(model, True)
    model(prompts, 0)
    compiled = step(nxt, pos, torch.arange(3, device=dev))
    assert compiled.shape == eager.shape
    assert step.seen.keys() == {(4, True)}
    # int8: bf16 activations, and Inductor keeps fused intermediates in fp32, so logits differ by bf16 rounding
    # (max 0.11 measured on CPU, 0.31 on an H200 (2026-11-26), logit std ~7), not more; int8-dynamic: an
    # activation code can round the other way. The greedy choice is the same.
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0.3 if dev.type == "cpu" else 0.4)
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


def test_own_storage_unshares_views():
    """Inductor's prepacking ignores storage offsets: weights sliced from one storage must become their own."""
    base = torch.arange(8.0)
    lin = torch.nn.Linear(2, 2, bias=False)
    lin.weight = torch.nn.Parameter(base[4:].view(2, 2))
    own_storage(lin)
    assert lin.weight.storage_offset() == 0 and lin.weight.untyped_storage().nbytes() == 16
    assert torch.equal(lin.weight, base[4:].view(2, 2))


def test_batch_buckets():
    assert [bucket(b, 32) for b in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert [bucket(b, 6) for b in (3, 5, 6)] == [4, 6, 6]


def test_bad_compile_argument(stories_dir):
    with pytest.raises(ValueError, match="compile must be"):
        build(stories_dir, compile="fast")


SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from llama import Llama

    ckpt, tokenizer, goldens, out = sys.argv[1:]
    prompts = [g["prompt_tokens"] for g in json.load(open(goldens)).values()]
    llama = Llama.build(ckpt, tokenizer, max_seq_len=160, max_batch_size=2, device="cpu", compile=True)
    greedy, _ = llama.generate(prompts, max_gen_len=64, temperature=0.0)
    seen = [list(k) for k in llama.runner.compiled.seen]
    with open(f"{out}.{os.environ['RANK']}.json", "w") as f:
        json.dump({"greedy": greedy, "seen": seen}, f)
    dist.barrier()
""")


def test_compiled_under_model_parallel_matches_goldens(goldens, two_ranks):
    """torchrun with 2 ranks on a 2-shard checkpoint: the all-reduces and all-gathers are functional collectives
    inside each rank's compiled graph, and both ranks give the reference's greedy ids."""
    ranks = two_ranks(SCRIPT)
    for rank in ranks:
        assert rank["seen"] == [[2, False]]  # every decode step ran in the compiled graph
        for got, g in zip(rank["greedy"], goldens.values()):
            assert got == g["generated_tokens"][:64]


# ------------------------------------------------------------------------------------------ compile="auto" (default)
def test_auto_leaves_small_models_eager(stories_dir):
    llama = build(stories_dir)  # the default, compile="auto": stories260K is far below AUTO_MIN_PARAMS
    assert llama.runner.compiled is None


def test_auto_compiles_a_batch_size_once_eager_decoding_has_cost_as_much(stories_dir, goldens, monkeypatch):
    """The lazy rule: decode eagerly at a batch size until that has taken the expected compile time (set tiny
    here), then compile it; both paths give the goldens, so the switch is invisible in the output."""
    monkeypatch.setenv("LLAMA_COMPILE_CACHE", "0")  # a step stored by another test would be taken at once
    llama = build(stories_dir, compile=False)
    step = llama.runner.compiled = CompiledDecode(llama.model, "default", lazy=True)
    step.eager_up_to = 0  # whatever the size rule says (this model is far below it): the lazy rule decides
    step.estimate = 0.01  # seconds of eager decoding before compiling (128 eager steps of this model: ~0.04 s)
    prompts = [g["prompt_tokens"] for g in goldens.values()]
    out, _ = llama.generate(prompts, max_gen_len=128, temperature=0)
    assert step.eager[(2, False)] >= 0.01 and (2, False) in step.seen
    assert step.cost() == step.seen[(2, False)]  # later batch sizes wait for the measured compile time
    for got, g in zip(out, goldens.values()):
        assert got == g["generated_tokens"]


def test_auto_leaves_batch_sizes_our_cpu_kernels_run_eager(monkeypatch):
    """Where our kernels run every product, attention and norm of a large model, "auto" keeps fp32 eager up to the
    rows our fp32 kernel takes, and bf16 and quantized models up to one tile of rows (their eager step is almost all
    weight streaming); smaller models, faster compiled, go by the lazy rule, as do models without our kernels or
    with layers in PyTorch's kernels."""
    from test_model import random_model

    from llama.kernels import cpu
    model = random_model(multiple_of=32)  # every input size a multiple of 32: all in our kernels
    KVCache(model, 8, 32)
    bf16 = random_model(multiple_of=32).to(torch.bfloat16)
    small = quantize_int8_dynamic(random_model(multiple_of=32))
    for m in (model, bf16, small):
        assert compiled_decode.eager_batches(m) == 0  # a few KB of weights: the lazy rule
    monkeypatch.setattr(compiled_decode, "EAGER_KERNEL_MIN_BYTES", 0)  # as if they were large
    step = CompiledDecode(model, "default", lazy=True)
    if not cpu.available():
        assert step.eager_up_to == 0
        return
    assert step.eager_up_to == compiled_decode.FP32_KERNEL_MAX_ROWS == 8 and not step.ready((8, False)) and not step.seen
    assert CompiledDecode(model, "default", lazy=False).ready((1, False))  # compile=True still compiles
    assert compiled_decode.eager_batches(bf16) == compiled_decode.EAGER_KERNEL_MAX_BATCH
    assert compiled_decode.eager_batches(small) == compiled_decode.EAGER_KERNEL_MAX_BATCH
    assert compiled_decode.eager_batches(quantize_int8(random_model())) == 0  # int8 weight-only: PyTorch's kernel
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert compiled_decode.eager_batches(model) == 0


def test_auto_keeps_the_default_gguf_model_eager_at_small_batches(monkeypatch):
    """compile="auto" never compiles the default model's (SmolLM2's GGUF blocks, 135M parameters, far below
    EAGER_KERNEL_MIN_BYTES) steps of up to EAGER_KERNEL_MAX_BATCH rows: its eager step is one call into our kernels,
    so a first run never stops to compile, nor imports Dynamo."""
    from conftest import SHARED

    from llama import Llama

    gguf = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    hardware.require_kernels()
    monkeypatch.setenv("LLAMA_GGML_ARITH", "0")
    g = Llama.build(str(gguf), None, max_seq_len=64, max_batch_size=1, compile="auto")
    step = g.runner.compiled
    assert compiled_decode.weight_bytes(g.model) < compiled_decode.EAGER_KERNEL_MIN_BYTES
    assert step is not None and step.eager_up_to == compiled_decode.EAGER_KERNEL_MAX_BATCH
    assert not step.ready(step.key(1, None))
    g.generate([[1, 504, 3575, 282, 4649, 314]], max_gen_len=4, temperature=0)
    assert not step.packages and not step.seen, (step.packages, step.seen)
    assert step._fn is None  # nor was torch.compile's wrapper made: making it imports Dynamo (seconds)


def test_a_batch_size_that_would_not_fit_in_memory_stays_eager(stories_dir, goldens, monkeypatch, capsys):
    monkeypatch.setattr(compiled_decode, "memory_allows", lambda model: False)
    llama = build(stories_dir, compile=True)
    prompts = [g["prompt_tokens"] for g in goldens.values()]
    out, _ = llama.generate(prompts, max_gen_len=16, temperature=0)
    assert llama.runner.compiled.refused == {(2, False)} and not llama.runner.compiled.seen
    assert "not enough free memory" in capsys.readouterr().out
    for got, g in zip(out, goldens.values()):
        assert got == g["generated_tokens"][:16]


def test_memory_check_counts_copied_weights_only(monkeypatch):
    from test_model import random_model

    from llama.kernels import cpu
    model = random_model(multiple_of=32)
    assert compiled_decode.memory_allows(model)  # a few KB of weights
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: io.StringIO("MemAvailable:  1024 kB\n")
                        if path == "/proc/meminfo" else real_open(path, *a, **k))
    # float weights in our kernels stay out of the graph: nothing to copy, even with 1 MB free
    assert compiled_decode.memory_allows(model) == cpu.available()
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert not compiled_decode.memory_allows(model)  # frozen into the graph: no room for another copy
    quantize_int8(model)
    assert compiled_decode.memory_allows(model)  # int8 weights are not copied into graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_step_reads_the_models_own_float_weights(dtype):
    """With our CPU kernels a compiled step calls them on the model's weights (no frozen copy in the graph): an
    in-place change to a weight after compiling shows in the next compiled step."""
    from test_model import random_model


    hardware.require_kernels()
    model = random_model(dtype=dtype, multiple_of=32)
    KVCache(model, 2, 32)
    step = CompiledDecode(model)  # compile=True's mode choice
    assert step.mode == "default" and step.config["freezing"] is False
    tokens, pos = torch.tensor([[3], [5]]), torch.tensor([0, 0])
    before = step(tokens, pos)
    with torch.no_grad():
        model.output.weight.mul_(2)
    after = step(tokens, pos)
    assert step.seen.keys() == {(2, False)}  # one graph, not recompiled
    torch.testing.assert_close(after.float(), 2 * before.float(), rtol=1e-2, atol=1e-3)
    assert not torch.equal(after, before)


def test_auto_applies_to_cpu_models_above_the_size_threshold(monkeypatch):
    from test_model import random_model

    model = random_model()
    monkeypatch.setattr(compiled_decode, "AUTO_MIN_PARAMS", 0)
    step = compile_decode(model, "auto")
    assert step.lazy and not step.seen
    monkeypatch.setattr(compiled_decode, "AUTO_MIN_PARAMS", 10**12)
    assert compile_decode(model, "auto") is None
    assert compile_decode(model, True).lazy is False  # True compiles on first use
    monkeypatch.setattr(compiled_decode, "AUTO_MIN_PARAMS", 0)
    monkeypatch.setattr(compiled_decode.parallel, "model_parallel_size", lambda: 2)
    assert compile_decode(model, "auto") is None  # ranks could switch at different steps: eager


@pytest.mark.parametrize("kernels", [True, False])
def test_large_fp32_batches_stay_eager(kernels, monkeypatch):
    """oneDNN's eager fp32 GEMM beats Inductor's template from batch 32 (measured), and Inductor's unfrozen choice
    where our kernels keep the weights out of the graph: such graphs are not compiled."""
    from test_model import random_model

    from llama.kernels import cpu
    if not kernels:
        monkeypatch.setattr(cpu, "available", lambda: False)
    else:
        hardware.require_kernels()
    model = random_model(max_batch=32, multiple_of=32)
    step = CompiledDecode(model, "auto")  # fp32: max-autotune on frozen weights, or our kernels
    assert step.mode == ("default" if kernels else "max-autotune")
    assert step.ready(step.key(8, None)) and not step.ready(step.key(20, None))  # 20 pads to 32
    assert step(torch.zeros(20, 1, dtype=torch.long), torch.zeros(20, dtype=torch.long)) is None  # eager instead
