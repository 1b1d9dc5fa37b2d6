"""Reading a model's memory-mapped weights into memory at load, as llama.cpp does (it maps with MAP_POPULATE).

Checkpoints load memory-mapped (torch.load(mmap=True), the pack caches), so build() returns in a fraction of a
second and the pages come in by page faults during the first forward passes instead: the disk lands in the first
token's latency, and in any step timed while pages are still coming in. When the mapped weights fit in available
memory, load() reads them here instead: the files behind them first, by several readers that each stream
their own share in order (a disk serves those faster than one stream of page faults), then one byte of every
page in order, which puts each page in this process's page tables. Reads, not madvise(MADV_POPULATE_READ): in a
virtual machine, memory the host has just filled from the disk faults again on the guest's first access, so only
a read leaves the first step nothing to wait for.
Pages read once are the first that reclaim takes when the page cache is full of files in use (another model's),
so the pages mincore then reports missing are read again, which marks them in use. Weights that do not fit stay
mapped lazily: reading them all at load would only evict what the first step needs. Linux only (the mappings come
from /proc/self/maps); elsewhere weights stay lazy.
"""

import ctypes
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Optional, Tuple

import torch
from tqdm import tqdm

from llama.formats import libc
from llama.loading import memory

_CHUNK = 256 << 20  # bytes touched per call
# The files are read first, by _READERS readers in _PIECE-byte requests: a virtual disk serves several streams at
# once faster than the one stream of page faults (7B bf16 from a cold page cache: docs/performance-history.md, "At 7B").
_READERS = 8
_PIECE = 16 << 20
_BUFFER = 4 << 20  # each reader's scratch buffer: the readers' buffers add to the load's peak RSS
_PAGE = mmap.PAGESIZE
_PASSES = 4  # reads of the pages still missing after the first
_mincore = libc.function("mincore", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p))


def mapped_files() -> List[Tuple[int, int, str, int]]:
    """(start, end, path, offset in the file) of each of this process's mappings of files, from /proc/self/maps,
    in address order; [] where there is none."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    out.append((int(lo, 16), int(hi, 16), fields[5].rstrip("\n"), int(fields[2], 16)))
    except OSError:
        return []
    return sorted(out)


def file_mappings() -> List[Tuple[int, int]]:
    """(start, end) of this process's mappings of files, adjacent ones joined (a mapping the kernel split still
    holds one storage); [] where there is none."""
    joined: List[Tuple[int, int]] = []
    for lo, hi, _, _ in mapped_files():
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


def file_pieces(storages: List[torch.UntypedStorage],
                maps: List[Tuple[int, int, str, int]]) -> List[Tuple[str, int, int]]:
    """(path, offset, length) of the file bytes behind each storage, in the storages' order, _PIECE bytes at most
    each."""
    pieces = []
    for storage in storages:
        ptr, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        for lo, hi, path, offset in maps:
            a, b = max(lo, ptr), min(hi, end)
            pieces += [(path, offset + start - lo, min(_PIECE, b - start)) for start in range(a, b, _PIECE)]
    return pieces


def reader_runs(pieces: List[Tuple[str, int, int]], readers: int) -> List[List[Tuple[str, int, int]]]:
    """The pieces cut into at most `readers` runs of consecutive pieces, about equal in bytes, in their order."""
    total = sum(n for _, _, n in pieces)
    runs: List[List[Tuple[str, int, int]]] = [[] for _ in range(readers)]
    done = 0
    for piece in pieces:
        runs[min(done * readers // max(total, 1), readers - 1)].append(piece)
        done += piece[2]
    return [run for run in runs if run]


def read_files(pieces: List[Tuple[str, int, int]], bar=None) -> int:
    """Read these pieces of files into the page cache, _READERS at a time; returns the bytes read. A file that
    cannot be opened or read is skipped (the pages then come in when they are touched).

    Each reader takes one run of consecutive pieces and reads it in order through descriptors of its own: the
    kernel's readahead then sees one sequential stream per descriptor and fills the page cache with large folios,
    which mappings of the file map with 2 MB entries (fewer TLB misses in every step that streams the weights).
    Pieces taken in turn from one shared descriptor look random to it and land mostly in small folios.
    (POSIX_FADV_SEQUENTIAL left out: the larger window it sets gave fewer large folios.)"""
    lock = threading.Lock()

    def read(run) -> int:
        fds, buffer, done = {}, memoryview(bytearray(_BUFFER)), 0  # the data is wanted in the page cache only
        try:
            for path, offset, length in run:
                if path not in fds:
                    try:
                        fds[path] = os.open(path, os.O_RDONLY)
                    except OSError:
                        fds[path] = None
                if fds[path] is None:
                    continue
                n = 0
                try:
                    while n < length:
                        got = os.preadv(fds[path], [buffer[:min(_BUFFER, length - n)]], offset + n)
                        if got == 0:
                            break
                        n += got
                except OSError:
                    pass
                done += n
                if bar is not None:
                    with lock:
                        bar.update(n)
        finally:
            for fd in fds.values():
                if fd is not None:
                    os.close(fd)
        return done

    with ThreadPoolExecutor(_READERS) as pool:  # os.preadv releases the GIL
        return sum(pool.map(read, reader_runs(pieces, _READERS)))


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
        read = read_files(file_pieces(storages, mapped_files()), bar)  # the disk, several requests in flight
        for storage in storages:  # then the pages into this process's page tables, and anything not read above
            data = _bytes(storage)
            for start in range(0, len(data), _CHUNK):
                data[start:start + _CHUNK:_PAGE].sum()  # one byte per page: each page faulted in, in order
        bar.update(max(0, total - read))
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
