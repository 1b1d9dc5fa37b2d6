"""Reading a model's memory-mapped weights into memory at load, as llama.cpp does (it maps with MAP_POPULATE).

Checkpoints load memory-mapped (torch.load(mmap=True), the pack caches), so build() returns in a fraction of a
second and the pages come in by page faults during the first forward passes instead: the disk lands in the first
token's latency, and in any step timed while pages are still coming in. When the mapped weights fit in available
memory, load() reads them here instead, by reading one byte of every page in file order (the faults read ahead
in large requests). A read, not madvise(MADV_POPULATE_READ): in a virtual machine, memory the host has just filled
from the disk faults again on the guest's first access, so only a read leaves the first step nothing to wait for.
Pages read once are the first that reclaim takes when the page cache is full of files in use (another model's),
so the pages mincore then reports missing are read again, which marks them in use. Weights that do not fit stay
mapped lazily: reading them all at load would only evict what the first step needs. Linux only (the mappings come
from /proc/self/maps); elsewhere weights stay lazy.
"""

import ctypes
import mmap
import sys
from typing import Iterable, List, Optional, Tuple

import torch
from tqdm import tqdm

from . import memory

_CHUNK = 256 << 20  # bytes read per call: a progress bar that moves
_PAGE = mmap.PAGESIZE
_PASSES = 4  # reads of the pages still missing after the first
try:
    _mincore = ctypes.CDLL(None, use_errno=True).mincore if sys.platform.startswith("linux") else None
    if _mincore is not None:
        _mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
except (OSError, AttributeError):
    _mincore = None


def file_mappings() -> List[Tuple[int, int]]:
    """(start, end) of this process's mappings of files, from /proc/self/maps, adjacent ones joined (a mapping
    the kernel split still holds one storage); [] where there is none."""
    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    spans.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    joined: List[Tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if joined and lo == joined[-1][1]:
            joined[-1] = (joined[-1][0], hi)
        else:
            joined.append((lo, hi))
    return joined


def check(mode) -> None:
    if not any(mode is v for v in (None, True, False)):
        raise ValueError(f"preload must be True, False or None (when the weights fit in memory), got {mode!r}")


def mapped_storages(tensors: Iterable[torch.Tensor],
                    spans: List[Tuple[int, int]]) -> List[torch.UntypedStorage]:
    """The distinct CPU storages among tensors that lie inside a file mapping, in address order (file order
    within each mapping, so that reading them in turn reads each file from start to end)."""
    seen, out = set(), []
    for t in tensors:
        if t is None or t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn:
            continue  # oneDNN's prepacked weights have no storage to read
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage of its own
            continue
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or ptr in seen:
            continue
        seen.add(ptr)
        if any(lo <= ptr and ptr + size <= hi for lo, hi in spans):
            out.append(storage)
    return sorted(out, key=lambda s: s.data_ptr())


def missing_pages(storage: torch.UntypedStorage) -> Optional[torch.Tensor]:
    """Byte offsets into storage, one in each of its pages the page cache lacks (mincore); None if unknown."""
    if _mincore is None:
        return None
    ptr, size = storage.data_ptr(), storage.nbytes()
    lo = ptr // _PAGE * _PAGE
    vec = torch.empty(-(-(ptr + size - lo) // _PAGE), dtype=torch.uint8)
    if _mincore(lo, ptr + size - lo, vec.data_ptr()) != 0:
        return None
    return (torch.nonzero((vec & 1) == 0).flatten() * _PAGE - (ptr - lo)).clamp_(min=0)


def read_weights(model: torch.nn.Module, mode: Optional[bool] = None, progress: bool = True) -> int:
    """Read the model's memory-mapped weights into memory; returns the bytes read (0 when none were).

    mode None: only when they fit in available memory with memory.MARGIN to spare (MemAvailable, or
    LLAMA_MEMORY_LIMIT); True: always; False: never (pages come in on first use)."""
    check(mode)
    if mode is False:
        return 0
    storages = mapped_storages([*model.parameters(), *model.buffers()], file_mappings())
    total = sum(s.nbytes() for s in storages)
    if total == 0:
        return 0
    if mode is None:
        have = memory.available_bytes()
        if have is not None and total * memory.MARGIN > have:
            return 0
    with torch.inference_mode(), tqdm(total=total, desc="reading weights", unit="B", unit_scale=True,
                                      disable=not progress or total < 1 << 30) as bar:
        for storage in storages:
            data = _bytes(storage)
            for start in range(0, len(data), _CHUNK):
                data[start:start + _CHUNK:_PAGE].sum()  # one byte per page: each page faulted in, in order
                bar.update(min(_CHUNK, len(data) - start))
        for _ in range(_PASSES):  # reclaim may have taken pages just read (the module's docstring): read those again
            again = 0
            for storage in storages:
                offsets = missing_pages(storage)
                if offsets is not None and len(offsets):
                    _bytes(storage)[offsets].sum()
                    again += len(offsets)
            if not again:
                break
    return total


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)
