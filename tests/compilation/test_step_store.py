"""Compiled decode steps kept on disk (AOTInductor packages): a new process loads the step an earlier one compiled
and gives the same greedy ids; compile="auto" takes a stored step at once; an unreadable package is rebuilt; the
key tells weights, batch sizes, rows and settings apart.

The tests here turn our CPU kernels off, so that the step freezes the weights into its package (as on CPUs without
them); test_step_store_kernels.py keeps them on (the step calls them on the model's own weights, bound at load).
Two files, so that two pytest workers share the compiles (--dist loadfile).

Each test that compiles pays one AOTInductor compile of stories260K's step (tens of seconds), so they share one
cache directory and one compile.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import GOLDENS, ON_CUDA, REPO, error_lines

from llama import Llama
from llama.compilation import step_store
from llama.compilation.compiled_decode import CompiledDecode
from llama.kernels import cpu
pytestmark = [
    pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                       reason="AOTInductor's CPU backend needs a C++ compiler (g++/clang++) on PATH"),
    pytest.mark.skipif(ON_CUDA, reason="hardware: compiled steps are kept on disk on the CPU only"),
]

LOAD = r'''
import json, sys, torch
torch.set_num_threads(1)
from llama import Llama
d, goldens = sys.argv[1], json.load(open(sys.argv[2]))
llama = Llama.build(d, d + "/tokenizer.model", max_seq_len=160, max_batch_size=2, compile=True)
out, _ = llama.generate([g["prompt_tokens"] for g in goldens.values()], max_gen_len=128, temperature=0)
assert out == [g["generated_tokens"] for g in goldens.values()], out
print("packages", sorted(llama.runner.compiled.packages), "loaded", sorted(llama.runner.compiled.loaded))
'''


def kernels_off(mp) -> None:
    """As on a machine without our CPU kernels: eager and compiled products in PyTorch's kernels."""
    mp.setattr(cpu, "available", lambda: False)
    mp.setattr(cpu, "_loaded", False)


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    kernels_off(monkeypatch)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, stories_dir, goldens):
    """A cache directory holding stories260K's batch-2 step, compiled here (the greedy ids checked on the way)."""
    path = tmp_path_factory.mktemp("llama-cache")
    with pytest.MonkeyPatch.context() as mp:
        kernels_off(mp)
        mp.setenv("LLAMA_CACHE", str(path))
        llama = build(stories_dir, compile=True)
        out, _ = llama.generate([g["prompt_tokens"] for g in goldens.values()], max_gen_len=128, temperature=0)
    step = llama.runner.compiled
    assert step.packages.keys() == {(2, False)} and not step.loaded  # compiled here, into a package
    assert out == [g["generated_tokens"] for g in goldens.values()]
    assert len(list((path / "aoti").glob("*/step.so"))) == 1
    return path


def build(stories_dir, **kw):
    return Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=160, max_batch_size=2,
                       **kw)


def run_load(cache, stories_dir, tmp_path, kernels=False):
    """LOAD in a new process (a library this process has loaded would be reused by the dynamic loader)."""
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    env = {**os.environ, "LLAMA_CACHE": str(cache), "PYTHONPATH": str(REPO), "LLAMA_CPU_KERNELS": "1" if kernels else "0"}
    proc = subprocess.run([sys.executable, str(script), str(stories_dir), str(GOLDENS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, error_lines(proc.stderr)
    return proc


def test_a_new_process_loads_the_stored_step_and_gives_the_goldens(cache, stories_dir, tmp_path):
    proc = run_load(cache, stories_dir, tmp_path)
    assert "Loading the compiled decode step for batch size 2" in proc.stdout
    assert "Compiling" not in proc.stdout
    assert "packages [(2, False)] loaded [(2, False)]" in proc.stdout


def test_auto_takes_a_stored_step_at_once(cache, stories_dir, monkeypatch):
    """compile="auto"'s lazy rule waits for eager decoding to cost a compile, unless the step is on disk."""
    monkeypatch.setenv("LLAMA_CACHE", str(cache))
    llama = build(stories_dir, compile=False)
    lazy = CompiledDecode(llama.model, lazy=True)
    lazy.eager_up_to = 0  # whatever the size rule says (this model is far below it): the lazy rule decides
    assert lazy.ready((2, False))  # stored: no eager time spent, yet ready
    assert not lazy.ready((1, False))  # not stored: waits
    assert lazy.cost() == lazy.estimate
    big = CompiledDecode(llama.model, lazy=True)
    big.eager_up_to = 4  # as for a model of 1 GB+ in our kernels: batch sizes up to 4 stay eager...
    assert big.ready((2, False))  # ...unless their step is stored
    assert not big.ready((1, False)) and not big.ready((4, False))


def test_an_unreadable_package_is_compiled_again(cache, stories_dir, tmp_path):
    [package] = (cache / "aoti").glob("*/step.so")
    head = package.read_bytes()[:1000]
    package.unlink()  # a new file: this process still maps the old one (truncating it in place would crash it)
    package.write_bytes(head)
    proc = run_load(cache, stories_dir, tmp_path)  # the goldens again, from a step compiled anew
    assert "ignoring the unreadable compiled step" in proc.stderr and "compiling again" in proc.stderr
    assert "packages [(2, False)] loaded []" in proc.stdout
    assert package.stat().st_size > 1000


def test_the_key_tells_weights_batch_sizes_rows_and_settings_apart(stories_dir):
    model = build(stories_dir, compile=False).model
    weights = step_store.fingerprint(model)
    assert step_store.fingerprint(model) == weights
    cfg = {"freezing": True, "max_autotune": True}
    paths = {step_store.package_path(weights, 2, False, cfg), step_store.package_path(weights, 4, False, cfg),
             step_store.package_path(weights, 2, True, cfg),
             step_store.package_path(weights, 2, False, {**cfg, "max_autotune": False})}
    assert len(paths) == 4
    with torch.no_grad():
        model.layers[3].feed_forward.w2.weight[0, 0] += 1.0  # the strided sample starts at element 0
    assert step_store.fingerprint(model) != weights


def test_turned_off_by_the_environment(stories_dir, monkeypatch):
    model = build(stories_dir, compile=False).model
    assert step_store.enabled(model)
    monkeypatch.setenv("LLAMA_COMPILE_CACHE", "0")
    assert not step_store.enabled(model)
    assert CompiledDecode(model).package_path((2, False)) is None


def test_int8_dynamic_compiles_in_every_process(stories_dir):
    """Its oneDNN-packed weights are opaque tensors that torch.export cannot trace: torch.compile, not a package."""
    model = build(stories_dir, compile=False, quantize="int8-dynamic").model
    assert not step_store.enabled(model)
    assert step_store.enabled(build(stories_dir, compile=False, quantize="int8").model)
