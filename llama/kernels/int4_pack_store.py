"""A cache of quantized weights in the layout the model holds, so a pre-quantized checkpoint loads without
concatenating or repacking anything.

Checkpoints store int8 and int4 weights in a portable, sliceable layout, one tensor per Meta weight
(llama/formats/quantized_checkpoint.py). The model holds the attention's q/k/v and the feed-forward's gate/up projections
fused, in its kernel's layout: our kernels (llama/kernels/cpu.py) take the stored layout itself, so only the fusing
copies, and the copies beside the checkpoint's pages would nearly double the load's peak memory; PyTorch's int4
kernel wants the codes interleaved by `aten._convert_weight_to_int4pack_for_cpu`, whose output depends on the CPU's
instruction set and may change between PyTorch versions, and repacking costs about as long as quantizing. So the
first load of a checkpoint writes the layers it had to build (fused or repacked; a single stored tensor is used as
it is) to `$LLAMA_CACHE/int4pack/` (default ~/.cache/llama), keyed by the checkpoint's files, the rank and
model-parallel size, the group size, the kernel, the PyTorch version and the CPU capability; later loads
memory-map it instead. `LLAMA_INT4_CACHE=0` turns the cache off. A cache file that cannot be read is ignored (and
rewritten); one that cannot be written (read-only disk, full disk) only costs the copy next time.
"""

import hashlib
import os
import sys
from pathlib import Path
from typing import Dict, Optional

import torch

from llama import settings
from llama.formats import meta_checkpoint
from llama.kernels import cpu
from llama.settings import cache_dir

FORMAT = 3  # bump when what is stored changes


def enabled() -> bool:
    return settings.get().int4_cache


def cache_path(ckpt_dir, rank: int, world_size: int, group_size: int) -> Optional[Path]:
    """Where this rank's packed weights of ckpt_dir live for this machine and PyTorch, or None when disabled."""
    if not enabled():
        return None
    h = hashlib.sha256()
    for p in sorted(meta_checkpoint.shard_paths(ckpt_dir)) + [Path(ckpt_dir) / "params.json"]:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(f"{FORMAT}|{rank}|{world_size}|{group_size}|{cpu.available()}|{torch.__version__}|"
             f"{torch.backends.cpu.get_cpu_capability()}".encode())
    return cache_dir() / "int4pack" / f"{h.hexdigest()[:32]}.pt"


def load(path: Optional[Path]) -> Optional[Dict[str, torch.Tensor]]:
    """The cached packed tensors (memory-mapped), or None when absent or unreadable."""
    if path is None or not path.is_file():
        return None
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # a truncated or foreign file: repack and rewrite it
        print(f"note: ignoring the unreadable pack cache {path} ({e.__class__.__name__}); rebuilding it",
              file=sys.stderr)
        return None


def save(path: Optional[Path], tensors: Dict[str, torch.Tensor]) -> None:
    """Write atomically (a concurrent load sees the old file or the whole new one); failure only warns."""
    if path is None or not tensors:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, tmp)
        os.replace(tmp, path)
    except OSError as e:
        print(f"note: could not cache the fused/packed weights in {path.parent} ({e}); the next load builds them again",
              file=sys.stderr)
        tmp.unlink(missing_ok=True)
