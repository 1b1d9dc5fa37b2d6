"""torch.compile of the one-token decode step (gpt-fast's approach), for decoding near memory bandwidth on CPU.

Decoding one sequence reads every weight once per token. Eager matrix-vector products (MKL) reach about half the
machine's bandwidth and every small operator costs a few microseconds; Inductor with max-autotune and freezing
(weights folded in as constants, so they can be prepacked for its own GEMV kernels) gets close to the limit and
fuses the norms, rotary embedding and activations. That needs static shapes: Transformer.decode_step attends
over the whole cache under a mask, so one graph serves every position of a given batch size.

Costs: compiling takes tens of seconds per batch size (Inductor caches compiled graphs and autotuning results on
disk, so later runs are faster), and frozen weights are copied into the compiled graph. Weights must not change
after compiling. Prefill and other calls stay eager.
"""

import time
from typing import Dict, Optional, Union

import torch
import torch._inductor.config as inductor_config

from . import parallel

MODES = ("max-autotune", "default")


class CompiledDecode:
    """Transformer.decode_step under torch.compile, one graph per batch size (and per rows given or not)."""

    def __init__(self, model, mode: str = "max-autotune"):
        if mode not in MODES:
            raise ValueError(f"compile mode must be one of {MODES}, got {mode!r}")
        # Set around every call, not as torch.compile options: Inductor reads `freezing` outside the options' scope.
        self.config = {"freezing": True, "max_autotune": mode == "max-autotune",
                       # no per-GEMM autotuning tables on stderr
                       "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
        self.model, self.mode = model, mode
        own_storage(model)
        self.seen: Dict[tuple, float] = {}  # (batch size, rows given) -> seconds the first call took
        self.reset()

    def reset(self) -> None:
        """Forget compiled graphs (the caches were reallocated)."""
        self.fn = torch.compile(self.model.decode_step, dynamic=False, fullgraph=True)
        self.seen.clear()

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, rows: Optional[torch.Tensor] = None):
        key = (tokens.shape[0], rows is not None)
        if key in self.seen:
            with inductor_config.patch(self.config):
                return self.fn(tokens, pos, rows)
        if parallel.is_main_process():
            print(f"Compiling the decode step for batch size {key[0]} ({self.mode}); done once per batch size")
        start = time.time()
        with inductor_config.patch(self.config):
            out = self.fn(tokens, pos, rows)
        self.seen[key] = time.time() - start
        return out


@torch.no_grad()
def own_storage(model) -> None:
    """Give every parameter that is a view into a larger storage its own copy.

    Inductor's max-autotune GEMM templates prepack frozen weights ignoring the storage offset, so a weight that
    is a slice of a shared storage (checkpoints that store all layers' wo in one tensor, as llama2.c conversions
    do) would be packed from the wrong bytes and give garbage.
    """
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.storage_offset() != 0 or p.untyped_storage().nbytes() != p.numel() * p.element_size():
                setattr(module, name, torch.nn.Parameter(p.clone(memory_format=torch.contiguous_format),
                                                         requires_grad=p.requires_grad))


def compile_decode(model, mode: Union[bool, str] = True) -> Optional[CompiledDecode]:
    """Make model.forward run one-token steps through a compiled decode_step; False removes it.

    mode: True or "max-autotune" (fastest, slowest to compile), "default" (no autotuning).
    """
    if mode is False or mode is None:
        model.compiled_step = None
        return None
    if mode is True:
        mode = "max-autotune"
    if parallel.model_parallel_size() > 1:
        raise ValueError("compile is not supported with model parallel (collectives inside the graph): "
                         "use compile=False when model_parallel_size > 1")
    model.compiled_step = CompiledDecode(model, mode)
    return model.compiled_step
