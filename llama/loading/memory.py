"""Refusing, before loading, a configuration whose memory would not fit: a clear error instead of an OOM kill.

estimate() counts what a rank holds once loaded: the linear layers' weights in the target dtype or quantization
scheme (every expert of an MoE layer: all are resident, whichever the tokens pick), the embedding, norms and MoE
routers in the target dtype, the KV cache (max_batch_size x max_seq_len, both K and V, in the activation dtype),
and, for compile=True/"max-autotune"/"default" with float weights on CPU, one frozen copy of the weights inside the
compiled graph, except in a single process where our CPU kernels run (the compiled step
calls them on the model's own weights; llama/compilation/compiled_decode.py). compile="auto" checks memory itself before compiling
and stays eager when a copy would not fit. Available memory is MemAvailable from /proc/meminfo, or the bytes in
$LLAMA_MEMORY_LIMIT (a number, optionally with a K/M/G/T suffix: for tests and for sharing a machine); on other
systems without the variable nothing is refused. The load itself streams (memory-mapped shards), so the estimate
is of the resident model, with a 10% margin for allocator slack and transient copies.
"""

import os
from contextlib import contextmanager
from typing import Dict, Optional

import torch

from llama import settings
from llama.formats import libc
from llama.kernels import cpu
from llama.model import ModelArgs
from llama.quantization import schemes

MARGIN = 1.10
ENV = "LLAMA_MEMORY_LIMIT"


class NotEnoughMemory(MemoryError, ValueError):
    """A configuration refused before loading (a MemoryError, and a ValueError about the arguments)."""


def available_bytes() -> Optional[int]:
    """$LLAMA_MEMORY_LIMIT if set, else MemAvailable, else None (cannot tell)."""
    if settings.get().memory_limit is not None:
        return settings.get().memory_limit
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def linear_bytes(n: int, k: int, scheme, dtype: torch.dtype, group_size: Optional[int]) -> int:
    """Bytes of an (n, k) linear weight: in dtype, or as the quantization scheme (a name or QuantScheme) holds it."""
    scheme = schemes.lookup(scheme)
    if scheme is not None:
        return scheme.linear_bytes(n, k, group_size)
    return n * k * torch.empty((), dtype=dtype).element_size()


def ffn_bytes(hidden: int, d: int, scheme, dtype: torch.dtype, group_size: Optional[int]) -> int:
    """Bytes of one SwiGLU FFN (a dense layer's, or one expert's): gate and up (fused), and down."""
    return linear_bytes(2 * hidden, d, scheme, dtype, group_size) + linear_bytes(d, hidden, scheme, dtype, group_size)


def estimate(args: ModelArgs, dtype: torch.dtype, scheme=None, group_size: Optional[int] = None,
             compile=None, world_size: int = 1, kernels: bool = False) -> Dict[str, int]:
    """Bytes one rank needs, by part: weights, embeddings, kv_cache, compile_copy, total. scheme: a quantization
    scheme's name or QuantScheme, or None. kernels: our CPU kernels run here (no compiled copy of float weights in
    a single process)."""
    scheme = schemes.lookup(scheme)
    d, hd, hidden = args.dim, args.head_dim, args.hidden_dim
    size = torch.empty((), dtype=dtype).element_size()
    attention = [(args.n_heads * hd + 2 * args.n_kv_heads * hd, d), (d, args.n_heads * hd)]
    vocab = max(args.vocab_size, 1)
    n_moe = sum(args.moe.is_moe(i) for i in range(args.n_layers)) if args.moe is not None else 0
    weights = args.n_layers * sum(linear_bytes(n, k, scheme, dtype, group_size) for n, k in attention)
    weights += (args.n_layers - n_moe) * ffn_bytes(hidden, d, scheme, dtype, group_size)
    if n_moe:  # every expert of every MoE layer is resident, whichever the tokens pick
        weights += n_moe * args.moe.n_experts * ffn_bytes(args.moe.hidden_dim, d, scheme, dtype, group_size)
    weights += linear_bytes(vocab, d, scheme, dtype, group_size)
    weights //= world_size
    norms = (2 * args.n_layers + 1) * d + (2 * args.n_layers * hd if args.qk_norm else 0)
    routers = n_moe * args.moe.n_experts * d if n_moe else 0  # float, whole on every rank
    embeddings = (vocab * d) // world_size * size + (norms + routers) * size
    kv = 2 * args.n_layers * args.max_batch_size * args.max_seq_len * (args.n_kv_heads // world_size) * hd * size
    eager_compile = compile is True or compile in ("max-autotune", "default")
    copy = weights if eager_compile and scheme is None and not (kernels and world_size == 1) else 0
    parts = {"weights": weights, "embeddings": embeddings, "kv_cache": kv, "compile_copy": copy}
    parts["total"] = int(sum(parts.values()) * MARGIN)
    return parts


def _smaller():
    """(label, dtype, scheme) of the smaller configurations a refusal names when they fit: bf16, then the smallest
    built-in schemes, each as it loads by default, then in bf16."""
    int8, int4 = schemes.INT8, schemes.INT4
    return (("dtype=bfloat16", torch.bfloat16, None),
            (f'quantize="{int8.name}"', int8.activation_dtype() or torch.bfloat16, int8),
            (f'quantize="{int4.name}"', int4.activation_dtype() or torch.float32, int4),
            (f'quantize="{int4.name}", dtype=bfloat16', torch.bfloat16, int4))


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def check_fits(args: ModelArgs, dtype: torch.dtype, scheme, group_size: Optional[int], compile,
               world_size: int = 1, device=None) -> None:
    """NotEnoughMemory, before any weight is read, when this configuration needs more than is available, naming
    what would fit (another dtype, a quantization, a shorter cache, no compile). CPU only: a CUDA device's
    memory is the device's own."""
    if device is not None and torch.device(device).type != "cpu":
        return
    have = available_bytes()
    if have is None:
        return
    kernels = cpu.available()
    scheme = schemes.lookup(scheme)
    need = estimate(args, dtype, scheme, group_size, compile, world_size, kernels)
    # ranks on this host (torchrun) draw on the same memory: each checks that all of them fit
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    have //= local
    if need["total"] <= have:
        return
    options, fitting = [], set()
    for label, dt, sc in _smaller():
        if sc in fitting:
            continue  # it already fits as it loads by default
        if (dt, sc) == (dtype, scheme):
            continue
        group = None if sc is None else sc.group_size
        if estimate(args, dt, sc, group, compile, world_size, kernels)["total"] <= have:
            options.append(label)
            fitting.add(sc)
    if need["compile_copy"] and need["total"] - int(need["compile_copy"] * MARGIN) <= have:
        options.append('compile="auto" or False (no frozen copy of the weights)')
    if need["kv_cache"] > need["total"] / 4:
        options.append("a smaller max_batch_size * max_seq_len (the KV cache is "
                       f"{_gb(need['kv_cache'])})")
    hint = ("; would fit: " + ", ".join(options)) if options else "; nothing smaller this package offers would fit"
    source = f"${ENV}" if settings.get().memory_limit is not None else "MemAvailable"
    raise NotEnoughMemory(
        f"not loading: this configuration needs about {_gb(need['total'])} (weights {_gb(need['weights'])}, "
        f"embeddings and norms {_gb(need['embeddings'])}, KV cache {_gb(need['kv_cache'])}, compiled copy "
        f"{_gb(need['compile_copy'])}, +{int((MARGIN - 1) * 100)}%) but {_gb(have)} is available ({source})"
        f"{' for each of ' + str(local) + ' ranks on this host' if local > 1 else ''}{hint}")


@contextmanager
def freed_memory_returned():
    """glibc keeps freed blocks under its adaptive mmap threshold (which grows to 32 MB) in the heap, where
    tensors allocated later pin them: a layer-by-layer load would keep every layer's temporaries resident. While
    loading, blocks of 1 MB and up get their own mappings, returned to the OS when freed; afterwards the thresholds
    glibc would have grown to are set (32 MB, trim at 64 MB). Elsewhere than glibc, nothing changes."""
    mallopt = libc.function("mallopt")
    if mallopt is None:
        yield
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 1 << 20)
    try:
        yield
    finally:
        mallopt(m_mmap_threshold, 32 << 20)
        mallopt(m_trim_threshold, 64 << 20)
