"""Llama.build's options resolve once into a LlamaConfig (llama/config/build_args.py): the checkpoint's kind read
once, defaults that depend on other options settled, and each option reaching the objects built from it."""

import logging
import shutil

import pytest
import torch
from conftest import SHARED, STORIES, need

from llama import Llama
from llama.config import BuildArgs, memory_config
from llama.formats import gguf_file, hf_checkpoint
from llama.formats import quantized_checkpoint
SMOLLM = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def stories(**options) -> BuildArgs:
    d = str(need(STORIES))
    return BuildArgs.of(**{"ckpt_dir": d, "tokenizer_path": d + "/tokenizer.model", "max_seq_len": 64,
                           "max_batch_size": 2, **options})


def test_the_checkpoint_kind_is_read_once_when_resolving(monkeypatch):
    calls = []
    for module, name in ((gguf_file, "find_gguf"), (hf_checkpoint, "find_hf"), (quantized_checkpoint, "stored_scheme")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    config = stories().resolve()
    assert config.model.kind == "meta" and config.model.gguf_path is None and config.model.hf_dir is None
    assert sorted(calls) == ["find_gguf", "find_hf", "stored_scheme"]
    calls.clear()
    Llama.from_config(config)  # loading asks the configuration, never the files again
    assert calls == []


def test_a_gguf_file_and_a_quantized_checkpoint_are_told_apart(tmp_path):
    gguf = BuildArgs.of(ckpt_dir=str(need(SMOLLM)), tokenizer_path=None, max_seq_len=64, max_batch_size=1).resolve()
    assert gguf.model.kind == "gguf" and gguf.model.gguf_path == SMOLLM
    from llama.quantization.cli import quantize_checkpoint

    quantize_checkpoint(need(STORIES), tmp_path / "int8", "int8", progress=False)
    shutil.copy(STORIES / "tokenizer.model", tmp_path / "int8")
    stored = BuildArgs.of(ckpt_dir=str(tmp_path / "int8"), tokenizer_path=str(tmp_path / "int8/tokenizer.model"),
                          max_seq_len=64, max_batch_size=1, device="cpu", quantize="int8").resolve()
    assert stored.model.kind == "quantized" and stored.quant.stored["scheme"] == "int8"
    assert stored.quant.scheme.name == "int8"


@pytest.mark.parametrize("options, compile", [
    ({}, "auto"),
    ({"speculative": "ngram"}, False),  # drafts would move compile="auto"'s timed switch
    ({"prefix_cache": "exact"}, False),  # exact positions are the eager passes' arithmetic
    ({"speculative": "ngram", "compile": True}, True),
])
def test_compile_auto_is_settled_by_the_other_options(options, compile):
    assert stories(**options).resolve().compile.mode is compile


def test_an_unknown_option_is_refused_with_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown option\(s\) kv_cache_size; it takes .*kv_cache_memory"):
        Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), 64, 2, kv_cache_size="1G")


def test_paths_of_the_wrong_type_are_refused_by_name():
    with pytest.raises(TypeError, match=r"ckpt_dir must be a path \(str or os.PathLike\), got None"):
        Llama.build(None, None, 64, 2)
    with pytest.raises(TypeError, match=r"tokenizer_path must be a path .* got 3"):
        Llama.build(str(STORIES), 3, 64, 2)


def test_refusals_come_before_loading(monkeypatch):
    from llama.loading import loader

    monkeypatch.setattr(loader, "load", lambda config: pytest.fail("loaded before refusing"))
    with pytest.raises(ValueError, match=r"runs on the CPU only: on cuda"):
        Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), 64, 2, speculative="ngram", device="cuda")
    with pytest.raises(ValueError, match=r"quantize must be one of"):
        Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), 64, 2, quantize="int3")


def test_each_option_reaches_what_is_built_from_it(caplog):
    """max_seq_len, prefix_cache, speculative and quantize travel one way, from the configuration down."""
    with caplog.at_level(logging.INFO, logger="llama"):
        g = Llama.from_config(stories(max_seq_len=48, prefix_cache="exact", speculative="ngram",
                                      quantize="int8-dynamic").resolve())
    assert g.config.scheduler.max_seq_len == 48
    assert g.model.params.max_seq_len == g.cache.max_seq_len == g.core.max_seq_len == g.inputs.max_seq_len == 48
    assert g.cache.pool.mode == "exact" and g.core.speculative == "ngram" and g.runner.compiled is None
    assert all(m.method.quantized for m in g.model.modules() if hasattr(m, "method"))
    assert any("llama config:" in r.message and "prefix_cache=exact" in r.getMessage() for r in caplog.records)


def test_a_model_built_by_hand_gets_its_sizes_from_its_params():
    built = Llama.from_config(stories(compile=False).resolve())
    g = Llama(built.model, built.tokenizer)
    assert g.config.model.kind == "memory" and g.config.scheduler.max_seq_len == built.model.params.max_seq_len
    assert g.config.model.dtype == torch.float32 and g.config.compile.eager
    with pytest.raises(ValueError, match=r"a compiled decode step was given with compile=False"):
        Llama(built.model, built.tokenizer, compiled=object(), config=memory_config(built.model))
