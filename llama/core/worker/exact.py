"""Where prefix_cache="exact" holds, checked when its cache is built: a configuration it does not cover is refused
rather than run with shape-dependent arithmetic, which would make a cached position silently differ from a fresh
prefill's.

Its row-invariant arithmetic (llama/kernels/invariant.py) is our CPU kernels': attention through the decode kernel,
which applies a sliding window (Mistral v0.1) and an attention multiplier (Granite) itself, over fp32 or bf16
activations with head_dim a multiple of 8. On CUDA nothing takes SDPA's and cuBLAS's place (their reductions depend
on the problem's shape), so "exact" is refused there; "on" runs.
"""

import torch

from llama.kernels import cpu
def check(model) -> None:
    """ValueError naming what keeps `model` (its device, dtype, head_dim, or this machine) out of the exact mode."""
    ref = model.norm.weight
    fix = "use prefix_cache='on' (or 'off')"
    if ref.device.type != "cpu":
        raise ValueError(f"prefix_cache='exact' runs on the CPU only, got a model on {ref.device}: its row-invariant "
                         f"arithmetic is our CPU kernels', and elsewhere attention and products reduce in an order "
                         f"that depends on the pass's shape, so a cached position would not be bitwise a fresh "
                         f"prefill's; {fix}")
    if ref.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"prefix_cache='exact' computes fp32 or bf16 activations, got {ref.dtype}: build with "
                         f"dtype='fp32' or 'bf16', or {fix}")
    head_dim = model.params.head_dim
    if head_dim % 8:
        raise ValueError(f"prefix_cache='exact' attends in our CPU kernel, which takes head_dim a multiple of 8, got "
                         f"{head_dim}; {fix}")
    if not cpu.available():
        raise ValueError(f"prefix_cache='exact' needs our CPU kernels (llama/kernels/cpu.py), which are not "
                         f"available here (disabled, no AVX2/FMA, or no C++ compiler); {fix}")
