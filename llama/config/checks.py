"""The options that refuse each other, checked in one place when a LlamaConfig is built, each with one message.

A refusal here happens before anything is loaded. What only the loaded model can tell (an exact prefix cache
needs eager passes our arithmetic owns: llama/core/worker/exact.py) is checked where the model is.
"""

import os

from llama.tokenizers.chat_format import TOOL_STYLES


def exact_compiled(compile) -> str:
    """Why prefix_cache="exact" and a compiled decode step are refused together."""
    return (f"prefix_cache='exact' computes every position by the eager passes' row-invariant arithmetic, which a "
            f"compiled decode step does not match bit for bit (compile={compile!r}): use compile=False with "
            f"prefix_cache='exact', or prefix_cache='on' with compile")


def check_speculation(config) -> None:
    """Drafts must never change an output: a verify pass gives the one-token step's logits bit for bit only in our
    CPU kernels, and only when the decode step does not switch from eager to compiled on a timer."""
    spec, device = config.speculative, config.model.device
    if spec.mode is None:
        return
    if device.type != "cpu":
        raise ValueError(f"speculative={spec.mode!r} runs on the CPU only: on {device.type} a verify pass "
                         "does not give the one-token step's logits bit for bit, so drafts could change outputs")
    if config.compile.mode == "auto":
        raise ValueError(f"speculative={spec.mode!r} with compile='auto': its switch from eager to compiled "
                         "steps is timed, so drafts would move it; use compile=True or compile=False")
    if spec.draft_model is not None and (config.parallel.model_parallel_size not in (None, 1)
                                         or config.parallel.staged or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise ValueError(f"draft_model={spec.draft_model!r} drafts in one process: run without model or pipeline "
                         "parallel")


def check_quantization(config) -> None:
    """A scheme runs on its devices only (QuantScheme.check_device), and stages load unquantized checkpoints."""
    quant = config.quant
    if quant.stored is not None and config.parallel.staged:
        raise ValueError(f"pipeline_parallel_size={config.parallel.pipeline_parallel_size} loads unquantized "
                         f"Meta-layout checkpoints only, not the quantized checkpoint in {config.model.path}")
    if quant.scheme is not None and config.model.kind != "memory":
        quant.scheme.check_device(config.model.device)  # before any weight is read


def check(config) -> None:
    """Every cross-option refusal of a LlamaConfig."""
    check_speculation(config)
    check_quantization(config)
    if config.cache.prefix_cache == "exact" and not config.compile.eager:
        raise ValueError(exact_compiled(config.compile.mode))
    if config.parallel.staged and config.compile.forced:
        raise ValueError(f"compile={config.compile.mode!r} is not available with pipeline_parallel_size="
                         f"{config.parallel.pipeline_parallel_size}: pipeline stages decode eagerly (pass "
                         "compile=False or 'auto')")
    if config.tool_style is not None and config.tool_style not in TOOL_STYLES:
        raise ValueError(f"tool_style must be one of {TOOL_STYLES} or None, got {config.tool_style!r}")
