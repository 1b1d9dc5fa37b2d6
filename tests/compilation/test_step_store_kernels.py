"""Compiled decode steps kept on disk with our CPU kernels on: the step calls them on the model's own weights (bound
at load, none in the package), for stories260K, an int4 model, a tied model and a GGUF file in its own blocks; a new process
loads what an earlier one stored. (test_step_store.py: the same with the kernels off, weights frozen in.)
"""

import os
import shutil
import subprocess
import sys

import hardware
import pytest
import torch
from conftest import ON_CUDA, REPO, error_lines, fresh_cache
from test_step_store import build, run_load

from llama.compilation import step_store
from llama.compilation.compiled_decode import CompiledDecode

pytestmark = [
    pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                       reason="AOTInductor's CPU backend needs a C++ compiler (g++/clang++) on PATH"),
    pytest.mark.skipif(ON_CUDA, reason="hardware: compiled steps are kept on disk on the CPU only"),
]


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory, stories_dir, goldens):
    """A cache directory holding stories260K's batch-2 step compiled with our CPU kernels on: the step calls them
    on the model's weights, so the package holds none."""
    hardware.require_kernels()
    path = fresh_cache(tmp_path_factory.mktemp("llama-cache"))  # run_load's process: the kernels, not a build
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLAMA_CACHE", str(path))
        llama = build(stories_dir, compile=True)
        out, _ = llama.generate([g["prompt_tokens"] for g in goldens.values()], max_gen_len=128, temperature=0)
    step = llama.runner.compiled
    assert step.config["freezing"] is False and step.packages.keys() == {(2, False)} and not step.loaded
    assert out == [g["generated_tokens"] for g in goldens.values()]
    [stored] = (path / "aoti").glob("*/step.so")
    assert (stored.parent / step_store.CALLS).is_file()  # the calls of our ops, beside the library
    return path


def test_a_step_calling_our_kernels_is_stored_without_the_weights(kernel_cache, stories_dir, tmp_path, monkeypatch):
    """A new process loads it and gives the goldens; loaded here, it reads the model's own weights: a weight changed
    in place after loading shows in its logits (a package holding a copy would not see it)."""
    proc = run_load(kernel_cache, stories_dir, tmp_path, kernels=True)
    assert "packages [(2, False)] loaded [(2, False)]" in proc.stdout and "Compiling" not in proc.stdout
    monkeypatch.setenv("LLAMA_CACHE", str(kernel_cache))
    model = build(stories_dir, compile=False).model
    step = CompiledDecode(model)
    tokens, pos = torch.tensor([[5], [7]]), torch.tensor([0, 0])
    with torch.inference_mode():
        before = step(tokens, pos)
        assert step.loaded == {(2, False)}
        model.output.weight.mul_(2)
        after = step(tokens, pos)
    torch.testing.assert_close(after, 2 * before)


def test_a_stored_int4_step_gives_what_torch_compile_gives(tmp_path, monkeypatch):
    """An int4 model whose layers all run in our int4 kernel: its step takes the model's codes (freezing off, so
    neither graph nor package holds a copy), and the stored step's logits are torch.compile's."""
    from test_model import random_model

    from llama.core.worker.kv_cache import KVCache
    from llama.layers import kernel_model
    from llama.quantization.int4 import quantize_int4

    hardware.require_kernels()
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path))
    model = quantize_int4(random_model(multiple_of=32).fuse(), 32)
    assert kernel_model(model)
    KVCache(model, 2, 32)
    tokens, pos = torch.tensor([[3], [5]]), torch.tensor([0, 0])
    outs = {}
    for keep in ("0", "1"):
        monkeypatch.setenv("LLAMA_COMPILE_CACHE", keep)
        step = CompiledDecode(model)
        assert step.config["freezing"] is False
        with torch.inference_mode():
            outs[keep] = step(tokens, pos)
        assert bool(step.packages) == (keep == "1")
    torch.testing.assert_close(outs["1"], outs["0"], rtol=1e-5, atol=1e-5)


# Two checks in one script, run in two new processes on one fresh cache directory (one python and torch start per
# process for both): a tied random model's step (argv: the tests directory, where to save its logits) and a GGUF
# file's block step (argv: the file). Each part's stdout follows a "== part" line; a part that raises prints its
# traceback there, for its own test to report.
TWICE = r'''
import os, sys, traceback, torch
os.environ["LLAMA_GGML_ARITH"] = "0"  # llama.cpp's arithmetic decodes eagerly: this checks the compiled step
torch.set_num_threads(1)
tests, logits_path, gguf = sys.argv[1:]
sys.path.insert(0, tests)


def tied():
    from test_model import random_model
    from llama.compilation.compiled_decode import CompiledDecode
    model = random_model(max_batch=2, max_seq=32).fuse()
    model.output.weight = model.tok_embeddings.weight  # tied, as SmolLM2 and Llama 3.2 1B/3B
    step = CompiledDecode(model)
    with torch.inference_mode():
        logits = torch.stack([step(torch.tensor([[3], [5]]), torch.tensor([0, 0])),
                              step(torch.tensor([[7], [2]]), torch.tensor([1, 1]))])
    torch.save(logits, logits_path)
    print("freezing", step.config["freezing"], "packages", sorted(step.packages), "loaded", sorted(step.loaded))


def gguf_blocks():
    from llama import Llama
    from llama.layers import linear_layers
    from llama.quantization.gguf_blocks import GGUFBlocks
    g = Llama.build(gguf, None, max_seq_len=64, max_batch_size=1, compile=True)
    assert g.model.output.weight is g.model.tok_embeddings.weight
    assert all(isinstance(m.method, GGUFBlocks) for m in linear_layers(g.model.layers[0]))  # the file's Q4_1 blocks
    out, _ = g.generate([[1, 20, 30, 40, 50, 60]], max_gen_len=8, temperature=0)
    print("out", out, "packages", sorted(g.runner.compiled.packages), "loaded", sorted(g.runner.compiled.loaded))


for part in (tied, gguf_blocks):
    print("==", part.__name__, flush=True)
    try:
        part()
    except Exception:
        print(traceback.format_exc())
    sys.stdout.flush()
'''


@pytest.fixture(scope="module")
def stored_twice(tmp_path_factory, stories_dir):
    """TWICE in two new processes on one fresh cache directory (our kernels on): {part: [first's, second's stdout]},
    and the directory (logits0.pt, logits1.pt: the tied model's logits in each process)."""
    from gguf_blocks_data import write_block_gguf

    hardware.require_kernels()
    tmp = tmp_path_factory.mktemp("stored_twice")
    # A two-layer random file of the default model's block type (Q4_1) and tying (SmolLM2, 135M): the same path at a
    # fraction of its compile.
    params = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 256, "norm_eps": 1e-5,
              "vocab_size": 512}
    gguf = write_block_gguf(tmp / "q4_1.gguf", params, stories_dir / "tokenizer.model", "Q4_1", tied=True)
    (tmp / "script.py").write_text(TWICE)
    env = {**os.environ, "LLAMA_CACHE": str(fresh_cache(tmp / "cache")), "PYTHONPATH": str(REPO)}
    parts = {"tied": [], "gguf_blocks": []}
    for i in range(2):
        proc = subprocess.run([sys.executable, str(tmp / "script.py"), str(REPO / "tests"), str(tmp / f"logits{i}.pt"),
                               str(gguf)], env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, error_lines(proc.stderr)
        assert "could not keep the compiled decode step" not in proc.stderr, error_lines(proc.stderr)
        for chunk in proc.stdout.split("== ")[1:]:
            name, _, out = chunk.partition("\n")
            parts[name].append(out)
    return parts, tmp


def test_a_tied_model_loads_its_stored_step_in_a_new_process(stored_twice):
    """A tied model's output.weight is its embedding's Parameter: the stored step (which calls our kernels on the
    model's weights) binds it by alias, so a second process loads the step the first compiled, with the same
    logits."""
    (first, second), tmp = stored_twice[0]["tied"], stored_twice[1]
    assert "freezing False packages [(2, False)] loaded []" in first, first
    assert "freezing False packages [(2, False)] loaded [(2, False)]" in second, second
    assert torch.equal(torch.load(tmp / "logits0.pt"), torch.load(tmp / "logits1.pt"))


def test_a_gguf_files_block_step_loads_in_a_new_process(stored_twice):
    """A GGUF file run in its own blocks, as the default model is (SmolLM2's Q4_1, tied embeddings): its compiled
    step is stored once per machine and a new process loads it, with the same greedy ids."""
    first, second = stored_twice[0]["gguf_blocks"]
    assert "packages [(1, False)] loaded []" in first, first
    assert "packages [(1, False)] loaded [(1, False)]" in second and "Compiling" not in second, second
    assert first.split("out ")[1].split(" packages")[0] == second.split("out ")[1].split(" packages")[0]
