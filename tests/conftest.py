"""Shared fixtures: paths into ../shared (skipped with a reason when absent) and one stories260K generator."""

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from llama import settings

# The test models are tiny: one thread is as fast, and never oversubscribes a shared 2-core machine.
torch.set_num_threads(1)

# The suite never writes the user's cache (the demo checkpoint, int4 pack caches); subprocesses inherit this. It is
# removed when the session ends, so runs do not pile up in /tmp. A test's subprocess that imports this module (a
# torchrun rank importing its test file) keeps the cache its test gave it: a new one would build the CPU kernels
# again in every rank (~40 s of CPU each).
if not ("PYTEST_CURRENT_TEST" in os.environ and os.environ.get("LLAMA_CACHE")):
    os.environ["LLAMA_CACHE"] = tempfile.mkdtemp(prefix="llama-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LLAMA_CACHE"], ignore_errors=True)

REPO = Path(__file__).resolve().parents[1]
SUITE_CACHE = Path(os.environ["LLAMA_CACHE"])
SHARED = Path(os.environ.get("LLAMA_SHARED") or REPO.parent / "shared")


def fresh_cache(path: Path) -> Path:
    """A new, empty LLAMA_CACHE at `path` for a test that checks what lands there (the demo checkpoint, a fetched
    model, compiled steps), sharing this session's compiled CPU kernels: a build costs ~40 s of CPU, and building
    into a fresh cache is tested once (tests/kernels/test_cpu.py)."""
    path.mkdir(parents=True, exist_ok=True)
    (SUITE_CACHE / "kernels").mkdir(exist_ok=True)
    if not (path / "kernels").is_symlink():
        (path / "kernels").symlink_to(SUITE_CACHE / "kernels")
    return path


# The device the suite runs on: LLAMA_TEST_DEVICE=cuda runs every model the tests build on the GPU (through
# LLAMA_DEVICE, which subprocesses inherit), in fp32 unless a test asks for another dtype, since the references
# (goldens, transformers in fp32) are fp32. Unset, the suite runs on the CPU even where a GPU is present.
DEVICE = os.environ.get("LLAMA_TEST_DEVICE", "cpu").strip() or "cpu"
os.environ["LLAMA_DEVICE"] = DEVICE
if DEVICE.startswith("cuda"):
    os.environ.setdefault("LLAMA_DTYPE", "float32")
ON_CUDA = DEVICE.startswith("cuda")


def _settings_follow(change):
    """llama.settings reads the environment once per process: a test that changes it (monkeypatch.setenv or
    delenv, and undo) makes the next settings.get() read it again."""
    def changed(self, *args, **kwargs):
        try:
            return change(self, *args, **kwargs)
        finally:
            settings.reset()
    return changed


for _change in ("setenv", "delenv", "undo"):
    setattr(pytest.MonkeyPatch, _change, _settings_follow(getattr(pytest.MonkeyPatch, _change)))


CPU_ONLY = pytest.mark.skipif(ON_CUDA, reason="hardware: int8-dynamic runs on the CPU only (oneDNN); CUDA uses int8")
# GGUF block formats and the one-call decode step run in our CPU kernels; on CUDA a GGUF file is dequantized at load
# and the step is the model's (tests/quantization/test_gguf_blocks.py::test_the_gpu_path_dequantizes_instead).
CPU_KERNELS_ONLY = pytest.mark.skipif(ON_CUDA, reason="hardware: runs in our CPU kernels; CUDA dequantizes GGUF blocks and "
                                                       "decodes with the model's own step")
# Speculative decoding and predictions are exact only in our CPU kernels: refused (ignored) on CUDA.
CPU_SPECULATION = pytest.mark.skipif(ON_CUDA, reason="hardware: speculative decoding runs on the CPU only (a CUDA verify pass "
                                                      "is not bitwise the one-token step)")
# Where the host's memory is measured (a load's peak RSS), a CUDA load puts the weights on the GPU instead.
HOST_MEMORY = pytest.mark.skipif(ON_CUDA, reason="hardware: measures host memory of a CPU load; on CUDA the weights go to the GPU")


# The files that take minutes (compiles, torchrun launches, servers), heaviest first (measured with --durations,
# 2026-11-29). They run first, so that under `-n 2 --dist loadfile` the two workers end together on the many light
# files; xdist's own order (files by test count) puts these few-test files last, where one of them alone is the
# tail. A stale entry costs balance, never a test.
SLOW_FIRST = (
    "compilation/test_compiled_decode.py", "formats/test_gguf_file.py", "formats/test_gguf_families.py",
    "compilation/test_step_store_kernels.py", "compilation/test_step_store.py", "distributed/test_tensor_parallel.py",
    "distributed/test_speculative_parallel.py", "compilation/test_compiled_speculation.py", "test_examples.py",
    "distributed/test_pipeline.py", "distributed/test_gguf_stages.py", "kernels/test_cpu.py", "serve/test_serve.py",
    "quantization/test_gguf_llama_cpp.py", "quantization/test_gguf_blocks.py", "hub/test_fetch.py",
    "distributed/test_pipeline_nodes.py", "tokenizers/test_pretokenizers.py", "quantization/test_int4.py",
    "formats/test_gguf_blocks_real.py", "serve/test_serve_tools.py", "cli/test_chat.py",
    "distributed/test_prefix_cache_parallel.py", "core/frontend/test_engine.py", "quantization/test_int8.py",
    "test_families.py", "test_llama3.py", "tokenizers/test_tool_vocab.py", "formats/test_gguf_moe.py",
    "formats/test_llama4_checkpoint.py", "serve/test_serve_qwen3.py", "formats/test_gguf_llama4.py",
)


# .ci/run sets LLAMA_CI=1: then a skip whose reason is not missing hardware (tests/hardware.py) fails the run.
IN_CI = os.environ.get("LLAMA_CI") == "1"


def _skip_reason(longrepr) -> str:
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail_unless_hardware(report) -> None:
    from hardware import allowed

    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report.longrepr)
        if not allowed(reason):
            report.outcome = "failed"
            report.longrepr = f"LLAMA_CI=1 allows skips for missing hardware only; this one was: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_unless_hardware(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_unless_hardware(outcome.get_result())


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the collection order (SLOW_FIRST)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    if ON_CUDA and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason=f"hardware: LLAMA_TEST_DEVICE={DEVICE} but this PyTorch sees no CUDA device")
        for item in items:
            item.add_marker(skip)
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    tests = Path(__file__).resolve().parent
    items.sort(key=lambda item: rank.get(Path(os.path.relpath(item.path, tests)).as_posix(), len(rank)))  # stable


def error_lines(stderr: str, tail: int = 2000) -> str:
    """What a failed subprocess said: its lines that name an error (which torchrun's long epilogue pushes out of
    a plain tail), then its last characters."""
    named = [line for line in stderr.splitlines() if "Error" in line or "error:" in line][:20]
    return "\n".join(named) + "\n...\n" + stderr[-tail:]


def rank_env(nproc: int = 1, **extra) -> dict:
    """Environment for a subprocess of the suite (torchrun with nproc ranks per node, or plain python): the
    repository first on PYTHONPATH, one thread per rank, and the CPU when the test device has fewer GPUs than
    ranks (model parallel needs one GPU per rank; those runs test gloo on the CPU instead)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": "1", **extra}
    if ON_CUDA and nproc > torch.cuda.device_count():
        env["LLAMA_DEVICE"] = env["LLAMA_TEST_DEVICE"] = "cpu"  # also for scripts that import conftest
    return env
STORIES = SHARED / "models" / "stories260K"
GOLDENS = SHARED / "goldens" / "stories260K_greedy.json"
LLAMA2_TOKENIZER = SHARED / "tokenizers" / "llama2" / "tokenizer.model"


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found: these tests need ../shared beside the repository")
    return path


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return need(STORIES)


@pytest.fixture(scope="session")
def goldens() -> dict:
    return json.loads(need(GOLDENS).read_text())


@pytest.fixture(scope="session")
def llama2_tokenizer_path() -> Path:
    return need(LLAMA2_TOKENIZER)


@pytest.fixture(scope="session")
def stories(stories_dir):
    """stories260K with room for the goldens' 128 new tokens, batch of 4. Prefix caching off: tests that count the
    positions a request computes share this generator (tests/core/scheduling/test_prefix_cache.py turns it on)."""
    from llama import Llama

    return Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=256, max_batch_size=4,
                       prefix_cache="off")


@pytest.fixture(scope="session")
def rand_gen(tmp_path_factory):
    """A random-weight model with the real 32000-piece Llama 2 tokenizer (byte fallback, multi-byte UTF-8)."""
    from llama import Llama
    from llama.hub.demo import write_random_checkpoint

    tokenizer = need(LLAMA2_TOKENIZER)
    d = tmp_path_factory.mktemp("rand_llama2")
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "norm_eps": 1e-5,
              "vocab_size": 32000}
    write_random_checkpoint(d, params, tokenizer_path=tokenizer, std=0.5)
    return Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=128, max_batch_size=4)


def run_two_ranks(tmp: Path, script: str, *extra: str, timeout: float = 600) -> list:
    """Run a script under `torchrun --standalone --nproc_per_node 2` on stories260K resharded into 2 shards in tmp.

    The script gets argv: checkpoint dir, tokenizer, goldens path, output prefix, then `extra`; each rank writes
    json to f"{prefix}.{RANK}.json". Returns the two ranks' json. A module-scoped fixture can call it once for
    several tests (one launch: one python, torch and process-group start instead of one per test).
    """
    import subprocess
    import sys

    from llama.formats.reshard import reshard

    reshard(need(STORIES), tmp / "two", 2)
    (tmp / "run.py").write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp / "run.py"), str(tmp / "two"), str(STORIES / "tokenizer.model"),
           str(need(GOLDENS)), str(tmp / "out"), *extra]
    proc = subprocess.run(cmd, cwd=tmp, env=rank_env(2), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, error_lines(proc.stderr)
    return [json.loads((tmp / f"out.{r}.json").read_text()) for r in range(2)]


@pytest.fixture
def two_ranks(stories_dir, tmp_path):
    """run_two_ranks in this test's tmp_path: two_ranks(script, *extra, timeout=600)."""
    return lambda script, *extra, timeout=600: run_two_ranks(tmp_path, script, *extra, timeout=timeout)


@pytest.fixture(params=["avx2", "avx512-vnni"])
def kernel_copy(request, monkeypatch):
    """Each copy of our quantized CPU kernels in turn: AVX2, and AVX-512 VNNI where the CPU has it
    (LLAMA_CPU_AVX512 picks the copy at call time)."""
    import torch

    vnni = all(torch.cpu.get_capabilities().get(f"avx512_{f}", False) for f in ("f", "bw", "dq", "vl", "vnni"))
    if request.param == "avx512-vnni" and not vnni:
        pytest.skip("hardware: this CPU has no AVX-512 VNNI")
    monkeypatch.setenv("LLAMA_CPU_AVX512", "0" if request.param == "avx2" else "1")
    return request.param
