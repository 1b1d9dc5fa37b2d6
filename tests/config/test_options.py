"""The configuration's parts (llama/config/options.py) check their own fields when built, and LlamaConfig refuses
the options that exclude each other (llama/config/checks.py), each with a message naming the input."""

import pytest
import torch

from llama.config import (CacheConfig, CompileConfig, LlamaConfig, ModelConfig, ParallelConfig, QuantConfig,
                          SchedulerConfig, SpeculativeConfig)

CPU = ModelConfig(kind="meta", device=torch.device("cpu"), dtype=torch.float32, path="ckpt")


@pytest.mark.parametrize("build, message", [
    (lambda: SchedulerConfig(0, 1), r"max_seq_len must be a positive integer, got 0"),
    (lambda: SchedulerConfig(8, True), r"max_batch_size must be a positive integer, got True"),
    (lambda: CacheConfig("sometimes"), r"prefix_cache must be True, False, 'on', 'exact' or 'off', got 'sometimes'"),
    (lambda: CacheConfig(memory=-1), r"kv_cache_memory must be a positive number of bytes.*got -1"),
    (lambda: CacheConfig(memory=float("nan")), r"kv_cache_memory must be a positive number of bytes"),
    (lambda: CacheConfig(memory="lots"), r"kv_cache_memory must be a byte count"),
    (lambda: CacheConfig(kv_dtype="int4"), r"kv_cache_dtype must be None .* got 'int4'"),
    (lambda: SpeculativeConfig("magic"), r"speculative must be None, 'off' or one of 'ngram', 'draft', got 'magic'"),
    (lambda: SpeculativeConfig("draft"), r"speculative='draft' drafts with a draft model"),
    (lambda: SpeculativeConfig("ngram", "small"), r"speculative='ngram' and draft_model='small' are two sources"),
    (lambda: ParallelConfig(0), r"model_parallel_size must be a positive integer, got 0"),
    (lambda: ParallelConfig(pipeline_parallel_size=1.5), r"pipeline_parallel_size must be a positive integer"),
    (lambda: QuantConfig(None, 32), r"group_size applies to quantize='int4' only, got group_size=32"),
    (lambda: QuantConfig("int3"), r"quantize must be one of .* got 'int3'"),
    (lambda: CompileConfig("fastest"), r"compile must be a bool, None or one of .* got 'fastest'"),
    (lambda: ModelConfig(kind="onnx", device=torch.device("cpu"), dtype=torch.float32), r"checkpoint kind must be"),
    (lambda: ModelConfig(kind="meta", device=torch.device("cpu"), dtype=torch.float32, seed=1.0),
     r"seed must be an integer, got 1.0"),
    (lambda: ModelConfig(kind="meta", device=torch.device("cpu"), dtype=torch.float32, preload="yes"),
     r"preload must be True, False or None"),
    (lambda: ModelConfig(kind="meta", device=torch.device("cpu"), dtype=torch.float32, rope_scaling_factor=0.5),
     r"rope_scaling_factor must be a finite number >= 1, got 0.5"),
])
def test_each_part_refuses_a_bad_value_by_name(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_parts_normalize_what_users_write():
    assert CacheConfig(True).prefix_cache == "on" and CacheConfig(False).prefix_cache == "off"
    assert CacheConfig(memory="1MiB").memory == 1 << 20
    assert SpeculativeConfig("off").mode is None and SpeculativeConfig(draft_model="d").mode == "draft"
    assert CompileConfig(None).eager and CompileConfig(True).forced and not CompileConfig("auto").forced


def config(**parts) -> LlamaConfig:
    return LlamaConfig(model=parts.pop("model", CPU), scheduler=SchedulerConfig(64, 2), **parts)


@pytest.mark.parametrize("parts, message", [
    (dict(speculative=SpeculativeConfig("ngram")), r"speculative='ngram' with compile='auto'"),
    (dict(speculative=SpeculativeConfig("ngram"), compile=CompileConfig(False),
          model=ModelConfig(kind="gguf", device=torch.device("cuda"), dtype=torch.float32)),
     r"speculative='ngram' runs on the CPU only: on cuda"),
    (dict(speculative=SpeculativeConfig(draft_model="d"), compile=CompileConfig(False), parallel=ParallelConfig(2)),
     r"draft_model='d' drafts in one process"),
    (dict(cache=CacheConfig("exact"), compile=CompileConfig(True)), r"prefix_cache='exact' .* \(compile=True\)"),
    (dict(cache=CacheConfig("exact")), r"prefix_cache='exact' .* \(compile='auto'\)"),
    (dict(parallel=ParallelConfig(pipeline_parallel_size=2), compile=CompileConfig("max-autotune")),
     r"compile='max-autotune' is not available with pipeline_parallel_size=2"),
    (dict(quant=QuantConfig("int8", None, {"scheme": "int8"}), parallel=ParallelConfig(pipeline_parallel_size=2)),
     r"pipeline_parallel_size=2 loads unquantized Meta-layout checkpoints only"),
    (dict(tool_style="xml"), r"tool_style must be one of"),
    (dict(quant=QuantConfig("int8-dynamic"), model=ModelConfig(kind="meta", device=torch.device("cuda"),
                                                               dtype=torch.float32)),
     r"quantize='int8-dynamic' runs on cpu only \(the model is on cuda\)"),
])
def test_options_that_exclude_each_other_are_refused_together(parts, message):
    with pytest.raises(ValueError, match=message):
        config(**parts)


def test_the_draft_refusal_reads_torchruns_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"drafts in one process"):
        config(speculative=SpeculativeConfig(draft_model="d"), compile=CompileConfig(False))
    config(speculative=SpeculativeConfig("ngram"), compile=CompileConfig(False))  # prompt lookup replays on ranks


def test_a_valid_configuration_is_frozen_and_summarized():
    c = config(cache=CacheConfig("exact", "4GiB"), compile=CompileConfig(False))
    with pytest.raises(Exception):
        c.cache = CacheConfig()
    line = c.summary()
    assert "ckpt (meta) on cpu, torch.float32" in line and f"kv_cache_memory={4 << 30}" in line
    assert "prefix_cache=exact" in line and "compile=False" in line
