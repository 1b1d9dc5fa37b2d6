"""llama.settings: every LLAMA_* variable parsed into its typed value, bad values refused naming the variable and
what it accepts, read once per process (until reset), and read nowhere else in the package."""

import re
from pathlib import Path

import pytest
import torch
from conftest import REPO

from llama import settings

VARIABLES = ("LLAMA_CACHE", "LLAMA_DEVICE", "LLAMA_DTYPE", "LLAMA_MEMORY_LIMIT", "LLAMA_CPU_KERNELS",
             "LLAMA_FUSED_DECODE", "LLAMA_GGUF_BLOCKS", "LLAMA_GGML_ARITH", "LLAMA_INT4_CACHE", "LLAMA_COMPILE_CACHE", "LLAMA_OFFLINE", "LLAMA_API_KEY",
             "LLAMA_ASYNC_DECODE", "LLAMA_GGUF_ACTIVATIONS", "LLAMA_SPECULATIVE_TIMING", "LLAMA_MODELS_DEBUG")
FLAGS = {"LLAMA_CPU_KERNELS": ("cpu_kernels", True), "LLAMA_FUSED_DECODE": ("fused_decode", True),
         "LLAMA_GGUF_BLOCKS": ("gguf_blocks", True), "LLAMA_GGML_ARITH": ("ggml_arith", False),
         "LLAMA_INT4_CACHE": ("int4_cache", True), "LLAMA_COMPILE_CACHE": ("compile_cache", True),
         "LLAMA_OFFLINE": ("offline", False)}


@pytest.fixture
def clean(monkeypatch):
    """No LLAMA_* variable set (the suite's conftest sets LLAMA_CACHE and LLAMA_DEVICE)."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults(clean):
    s = settings.reload()
    assert s == settings.Settings(cache=Path.home() / ".cache" / "llama", device=None, dtype=None, memory_limit=None,
                                  cpu_kernels=True, fused_decode=True, gguf_blocks=True, ggml_arith=False,
                                  gguf_activations="int16", int4_cache=True,
                                  compile_cache=True,
                                  offline=False, api_key=None, async_decode=None, speculative_timing="measured",
                                  models_debug=False)
    assert settings.cache_dir() == Path.home() / ".cache" / "llama"


def test_each_variable_is_parsed(clean, tmp_path):
    for name, value in (("LLAMA_CACHE", str(tmp_path)), ("LLAMA_DEVICE", "cuda:1"), ("LLAMA_DTYPE", "bf16"),
                        ("LLAMA_MEMORY_LIMIT", "1.5G"), ("LLAMA_API_KEY", " sk-test "), ("LLAMA_OFFLINE", "1")):
        clean.setenv(name, value)
    for name in ("LLAMA_CPU_KERNELS", "LLAMA_FUSED_DECODE", "LLAMA_GGUF_BLOCKS", "LLAMA_GGML_ARITH", "LLAMA_INT4_CACHE",
                 "LLAMA_COMPILE_CACHE"):
        clean.setenv(name, "off")
    s = settings.get()
    assert s.cache == tmp_path and settings.cache_dir() == tmp_path
    assert s.device == torch.device("cuda", 1) and s.dtype == torch.bfloat16
    assert s.memory_limit == int(1.5 * 2**30) and s.api_key == "sk-test" and s.offline
    assert not (s.cpu_kernels or s.fused_decode or s.gguf_blocks or s.ggml_arith or s.int4_cache or s.compile_cache)


def test_gguf_activations_take_int16_float_or_int8(clean):
    for text, want in (("int8", "int8"), (" INT8 ", "int8"), ("float", "float"), ("int16", "int16"), ("", "int16")):
        clean.setenv("LLAMA_GGUF_ACTIVATIONS", text)
        assert settings.reload().gguf_activations == want, text
    clean.setenv("LLAMA_GGUF_ACTIVATIONS", "fp16")
    with pytest.raises(ValueError, match=r"LLAMA_GGUF_ACTIVATIONS must be one of \['int16', 'float', 'int8'\].*'fp16'"):
        settings.reload()


def test_models_debug_is_llama_models_switch(clean):
    """llama-models prints Llama4.generate's input when LLAMA_MODELS_DEBUG is exactly "1"; so does
    llama.llama4.generation."""
    assert not settings.reload().models_debug
    clean.setenv("LLAMA_MODELS_DEBUG", "1")
    assert settings.reload().models_debug
    clean.setenv("LLAMA_MODELS_DEBUG", "yes")
    assert not settings.reload().models_debug


def test_speculative_timing_takes_measured_or_prior(clean):
    clean.setenv("LLAMA_SPECULATIVE_TIMING", " Prior ")
    assert settings.reload().speculative_timing == "prior"
    clean.setenv("LLAMA_SPECULATIVE_TIMING", "never")
    with pytest.raises(ValueError, match=r"LLAMA_SPECULATIVE_TIMING must be one of \['measured', 'prior'\]"):
        settings.reload()


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_flags_take_the_usual_spellings(clean, name):
    field, default = FLAGS[name]
    assert getattr(settings.get(), field) is default
    for text in settings.TRUE + ("TRUE", " On "):
        clean.setenv(name, text)
        assert getattr(settings.get(), field) is True, text
    for text in settings.FALSE + ("False", " OFF "):
        clean.setenv(name, text)
        assert getattr(settings.get(), field) is False, text
    clean.setenv(name, "")
    assert getattr(settings.get(), field) is default


def test_async_decode_is_auto_unless_set(clean):
    assert settings.get().async_decode is None
    for text, want in (("auto", None), (" AUTO ", None), ("on", True), ("1", True), ("off", False), ("no", False)):
        clean.setenv("LLAMA_ASYNC_DECODE", text)
        assert settings.get().async_decode is want, text


@pytest.mark.parametrize("name, value, message", [
    ("LLAMA_ASYNC_DECODE", "maybe", "LLAMA_ASYNC_DECODE must be auto or one of ('1', 'true', 'yes', 'on', '0', "
                                    "'false', 'no', 'off') (or unset), got 'maybe'"),
    *[(name, "maybe", f"{name} must be one of ('1', 'true', 'yes', 'on', '0', 'false', 'no', 'off') (or unset), "
                      "got 'maybe'") for name in sorted(FLAGS)],
    ("LLAMA_DEVICE", "gpu", "LLAMA_DEVICE must name a device such as cpu, cuda or cuda:1, got 'gpu'"),
    ("LLAMA_DTYPE", "float64", "LLAMA_DTYPE must be one of ['bf16', 'bfloat16', 'float16', 'float32', 'fp16', "
                               "'fp32', 'half'], got 'float64'"),
    ("LLAMA_MEMORY_LIMIT", "lots", "LLAMA_MEMORY_LIMIT must be a byte count such as 8G, 512M or 1000000, got 'lots'"),
    ("LLAMA_MEMORY_LIMIT", "0", "LLAMA_MEMORY_LIMIT must be a positive, finite byte count, got '0'"),
    ("LLAMA_MEMORY_LIMIT", "inf", "LLAMA_MEMORY_LIMIT must be a positive, finite byte count, got 'inf'"),
])
def test_bad_values_are_refused_naming_the_variable(clean, name, value, message):
    clean.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        settings.get()


def test_read_once_until_reset(monkeypatch):
    """get() does not look at the environment again: the decode loop reads a field, not os.environ."""
    monkeypatch.setenv("LLAMA_FUSED_DECODE", "1")
    first = settings.get()
    assert settings.get() is first and first.fused_decode
    monkeypatch.setattr("os.environ", {**__import__("os").environ, "LLAMA_FUSED_DECODE": "0"})  # no reset
    assert settings.get() is first
    settings.reset()
    assert settings.get() is not first and not settings.get().fused_decode


def test_no_other_module_reads_a_llama_variable():
    """Only llama/settings.py names a LLAMA_* variable next to os.environ/os.getenv."""
    pattern = re.compile(r"(environ|getenv)[^\n]*[\"']LLAMA_|[\"']LLAMA_[A-Z0-9_]+[\"'][^\n]*environ")
    readers = [str(p.relative_to(REPO)) for p in sorted((REPO / "llama").rglob("*.py"))
               if p.name != "settings.py" and pattern.search(p.read_text())]
    assert readers == []


def test_each_reader_takes_its_setting(clean, tmp_path):
    """The modules that used to read os.environ read these settings."""
    from llama.compilation import step_store
    from llama.distributed import parallel
    from llama.hub import demo, fetch
    from llama.loading import memory
    from llama.kernels import cpu
    from llama.kernels import int4_pack_store
    from llama.serve.__main__ import parse_args

    for name, value in (("LLAMA_CACHE", str(tmp_path)), ("LLAMA_DEVICE", "meta"), ("LLAMA_DTYPE", "bf16"),
                        ("LLAMA_MEMORY_LIMIT", "1G"), ("LLAMA_API_KEY", "sekrit"), ("LLAMA_CPU_KERNELS", "0"),
                        ("LLAMA_INT4_CACHE", "no")):
        clean.setenv(name, value)
    assert parallel.default_device() == torch.device("meta")
    assert parallel.resolve_dtype(None, torch.device("cpu")) == torch.bfloat16
    assert memory.available_bytes() == 2**30
    assert parse_args(["--ckpt_dir", "x"]).api_keys == ["sekrit"]
    assert not cpu.enabled() and not int4_pack_store.enabled()
    assert fetch.model_path().parent.parent == tmp_path and demo.demo_dir() == tmp_path / "demo"
    assert step_store.package_path("w", 1, False, {}).parent == tmp_path / "aoti"
    clean.setenv("LLAMA_DEVICE", "gpu")
    with pytest.raises(ValueError, match="LLAMA_DEVICE must name a device"):
        parallel.default_device()
