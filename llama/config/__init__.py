"""A generator's typed configuration: Llama.build's options (BuildArgs) resolved once into a LlamaConfig whose
parts each object takes when it is built (docs/architecture.md, "Configuration")."""

from llama.config.build_args import BuildArgs, memory_config
from llama.config.options import (CacheConfig, CompileConfig, LlamaConfig, ModelConfig, ParallelConfig, QuantConfig,
                                  SchedulerConfig, SpeculativeConfig)

__all__ = ["BuildArgs", "memory_config", "CacheConfig", "CompileConfig", "LlamaConfig", "ModelConfig",
           "ParallelConfig", "QuantConfig", "SchedulerConfig", "SpeculativeConfig"]
