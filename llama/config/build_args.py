"""Llama.build's options as a user gives them, and their resolution into one LlamaConfig (as vLLM's EngineArgs).

Resolving reads what the checkpoint is once (GGUF file, Hugging Face directory, a quantized or a plain Meta-layout
checkpoint), picks the device, dtype and quantization scheme, and settles the defaults that depend on other
options (compile="auto" is eager under speculation or an exact prefix cache). Nothing is loaded.
"""

import os
from dataclasses import dataclass, fields
from typing import Optional, Union

import torch

from llama.config.options import (CacheConfig, CompileConfig, LlamaConfig, ModelConfig, ParallelConfig, QuantConfig,
                                  SchedulerConfig, SpeculativeConfig)
from llama.distributed import parallel
from llama.formats import gguf_file, hf_checkpoint
from llama.formats import quantized_checkpoint
from llama.quantization import registry
from llama.quantization.registry import QuantScheme
from llama.quantization import schemes
@dataclass
class BuildArgs:
    """Every option of Llama.build, as given; resolve() checks them once.

    quantize="int8": int8 weight-only linear layers (activations bf16 unless dtype says otherwise);
    "int8-dynamic" (CPU): int8 weights times int8 activations quantized on the fly, as llama.cpp's q8_0
    (llama/quantization/cli.py); "int4" (CPU): group-wise 4-bit weights, group_size inputs per scale (default 32;
    llama/quantization/int4.py), activations fp32 unless dtype says otherwise. On x86 CPUs with AVX2 both run in
    our own kernels (llama/kernels/cpu.py, compiled at install, else once on first use), as do bf16 weights.
    A checkpoint written by `python -m llama.quantize` loads without requantizing: int4 as int4, int8 as the
    fastest int8 scheme the device runs (int8-dynamic in our CPU kernels, else weight-only; quantize="int8"
    asks for weight-only).
    GGUF blocks multiply int16 activation blocks on CPU (LLAMA_GGUF_ACTIVATIONS=float: fp32 ones; int8:
    llama.cpp's int8 blocks).
    A configuration whose weights and KV cache would not fit in available memory (or LLAMA_MEMORY_LIMIT
    bytes) is refused before loading, naming what would fit (llama/loading/memory.py).
    compile="auto" (default): on CPU, models of 50M+ parameters compile their one-token decode step once eager
    decoding has cost what compiling would (a GGUF file's small batches stay eager: no gain); True compiles on
    first use; "max-autotune"/"default" pick Inductor's mode; False never compiles (llama/compilation/compiled_decode.py).
    rope_scaling_factor: Llama 3.1 rotary scaling with this factor (32 for Llama 3.2 1B/3B, whose params.json
    cannot say so).
    pipeline_parallel_size: P > 1 splits the layers into P stages under torchrun, each tensor-parallel over
    model_parallel_size ranks (world size = T x P; docs/pipeline.md); stages decode eagerly.
    preload: memory-mapped weights are read into memory before build returns, so the first token does not
    wait for the disk: None (default) when they fit in available memory, True always, False never
    (llama/loading/preload.py).
    kv_cache_memory: bytes (or "4GiB") of this rank's paged KV pool; default max_batch_size x max_seq_len
    positions, as slots held before (llama/core/worker/kv_cache.py). prefix_cache: "on" (default) reuses the longest
    cached prefix of every prompt, "exact" too, with every position computed by row-invariant arithmetic so a
    cached one is bitwise a fresh prefill's (eager: compile="auto" means False with it, compile=True is
    refused), "off" none (llama/core/scheduling/paging.py).
    kv_cache_dtype="int8": keys and values as int8, each head rotated (Hadamard), then q8_0's fp16 scale per 32
    of a position's head (about half of bf16; read by the torch paths, eager: docs/architecture.md).
    tool_style: Meta Llama 3 checkpoints' tool-call syntax, "llama3_json" (3.1) or "pythonic" (3.2, 3.3);
    default by the checkpoint's shape (3.2's 1B/3B pythonic; 3.3 70B cannot be told from 3.1 70B).
    speculative="ngram": prompt-lookup speculative decoding, outputs identical to plain decoding (greedy and
    seeded); with compile=True drafts are verified by the compiled step (bitwise where our kernels take every
    product, fp32), compile="auto" means False with it; pipeline stages too; CPU only (on CUDA a verify pass is
    not bitwise the one-token step) (llama/core/speculation/speculative.py).
    draft_model: a smaller checkpoint with the same tokenizer drafts (speculative="draft", implied; a seeded
    request's drafts with its own seeded draws), outputs as without it (llama/core/speculation/draft_model.py).
    """
    ckpt_dir: str
    tokenizer_path: Optional[str]
    max_seq_len: int
    max_batch_size: int
    model_parallel_size: Optional[int] = None
    seed: int = 1
    device: Union[str, torch.device, None] = None
    dtype: Union[str, torch.dtype, None] = None
    verify: bool = False
    compile: Union[bool, str, None] = "auto"
    quantize: Union[str, QuantScheme, None] = None
    rope_scaling_factor: Optional[float] = None
    pipeline_parallel_size: int = 1
    group_size: Optional[int] = None
    preload: Optional[bool] = None
    kv_cache_memory: Union[int, str, None] = None
    prefix_cache: Union[bool, str] = "on"
    kv_cache_dtype: Optional[str] = None
    tool_style: Optional[str] = None
    speculative: Optional[str] = None
    draft_model: Optional[str] = None

    @classmethod
    def of(cls, **options) -> "BuildArgs":
        """BuildArgs from keyword options, an unknown one refused by name with the known ones listed."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"Llama.build got unknown option(s) {', '.join(unknown)}; it takes {', '.join(sorted(known))}")
        return cls(**options)

    def resolve(self) -> LlamaConfig:
        """The LlamaConfig these options give: checked, the checkpoint's kind read once, defaults settled."""
        speculative = SpeculativeConfig(self.speculative, self.draft_model)
        cache = CacheConfig(self.prefix_cache, self.kv_cache_memory, self.kv_cache_dtype)
        scheduler = SchedulerConfig(self.max_seq_len, self.max_batch_size)
        parallel_config = ParallelConfig(self.model_parallel_size, self.pipeline_parallel_size)
        compile = CompileConfig(self.compile)
        # compile="auto" times its switch from eager to compiled steps, which drafts would move, and an exact
        # prefix cache computes by the eager passes' arithmetic: both mean eager there
        if compile.mode == "auto" and (speculative.mode is not None or cache.prefix_cache == "exact"):
            compile = CompileConfig(False)
        device = torch.device(self.device) if self.device is not None else parallel.default_device()
        model, quant = self._checkpoint(device, parallel_config)
        return LlamaConfig(model=model, scheduler=scheduler, cache=cache, quant=quant, compile=compile,
                           speculative=speculative, parallel=parallel_config, tool_style=self.tool_style)

    def _checkpoint(self, device: torch.device, parallel_config: ParallelConfig):
        """(ModelConfig, QuantConfig): what the checkpoint is, read once, and the scheme it loads in."""
        for name in ("ckpt_dir", "tokenizer_path"):
            value = getattr(self, name)
            if not isinstance(value, (str, os.PathLike)) and not (name == "tokenizer_path" and value is None):
                raise TypeError(f"{name} must be a path (str or os.PathLike), got {value!r}")
        gguf_path = gguf_file.find_gguf(self.ckpt_dir)
        hf_dir = None if gguf_path is not None else hf_checkpoint.find_hf(self.ckpt_dir)
        stored = None if gguf_path is not None or hf_dir is not None else quantized_checkpoint.stored_scheme(self.ckpt_dir)
        kind = "gguf" if gguf_path else "hf" if hf_dir else "quantized" if stored else "meta"
        quantize, group_size = registry.lookup(self.quantize), self.group_size
        if stored is not None and not parallel_config.staged:  # the pipeline's refusal is LlamaConfig's (checks.py)
            quantize, group_size = quantized_checkpoint.check_request(self.ckpt_dir, stored, quantize, group_size,
                                                                  device)
        dtype = parallel.resolve_dtype(schemes.activation_dtype(quantize) if self.dtype is None else self.dtype,
                                       device)
        model = ModelConfig(kind=kind, device=device, dtype=dtype, path=str(self.ckpt_dir),
                            tokenizer_path=self.tokenizer_path, gguf_path=gguf_path, hf_dir=hf_dir, seed=self.seed,
                            verify=self.verify, rope_scaling_factor=self.rope_scaling_factor, preload=self.preload)
        return model, QuantConfig(quantize, group_size, stored)

    def draft(self) -> "BuildArgs":
        """The draft model's options: its own checkpoint, on this model's device, eager, no prefix cache, no
        speculation of its own; the model's tokenizer (a draft shares it), or a GGUF draft's own."""
        return BuildArgs(self.draft_model, self.tokenizer_path, self.max_seq_len, self.max_batch_size, seed=self.seed,
                         device=self.device, dtype=self.dtype, preload=self.preload, compile=False,
                         prefix_cache="off")


def memory_config(model, max_batch_size: Optional[int] = None, max_seq_len: Optional[int] = None,
                  compile: Union[bool, str, None] = False, prefix_cache: Union[bool, str] = "on",
                  kv_cache_memory: Union[int, str, None] = None, kv_cache_dtype: Optional[str] = None,
                  tool_style: Optional[str] = None, speculative: Optional[str] = None) -> LlamaConfig:
    """The configuration of a generator around a model already built (Meta's Llama(model, tokenizer)): sized by
    model.params unless given, the model's own device and dtype. compile says what the caller's compiled step is
    (False: none; "auto": one that switches on a timer)."""
    params, ref = model.params, model.norm.weight
    return LlamaConfig(
        model=ModelConfig(kind="memory", device=ref.device, dtype=ref.dtype),
        scheduler=SchedulerConfig(params.max_seq_len if max_seq_len is None else max_seq_len,
                                  params.max_batch_size if max_batch_size is None else max_batch_size),
        cache=CacheConfig(prefix_cache, kv_cache_memory, kv_cache_dtype), compile=CompileConfig(compile),
        speculative=SpeculativeConfig(speculative), tool_style=tool_style)

