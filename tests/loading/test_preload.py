"""preload: memory-mapped weights are read into memory at load when they fit, lazily otherwise."""

import mmap
import os
import threading

import numpy as np
import pytest
import torch
from conftest import HOST_MEMORY

from llama import Llama
from llama.loading import loader, preload
from llama.hub.demo import train_demo_tokenizer, write_random_checkpoint

pytestmark = HOST_MEMORY  # the page cache behind memory-mapped weights; a CUDA load copies them to the GPU

PARAMS = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 64, "norm_eps": 1e-5,
          "vocab_size": 2048}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("preload")
    tok = train_demo_tokenizer(d / "demo.model")
    write_random_checkpoint(d, PARAMS, tokenizer_path=tok, dtype=torch.bfloat16)
    return d


def smaps_bytes(path, field: str = "Rss") -> int:
    """Bytes of this process's mappings of this file by an smaps field: Rss (in its page tables), FilePmdMapped
    (mapped with 2 MB entries). Other tests' models in the same process map files of the same name: only this
    path counts."""
    want, total, inside = str(path.resolve()), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = len(head) == 6 and head[5].rstrip("\n") == want
            elif inside and head[0] == field + ":":
                total += int(head[1]) * 1024
    return total


def evict(path):
    """Drop path's pages from the page cache (those no process maps)."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())  # pages still to be written back cannot be dropped
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def build(ckpt, monkeypatch, **kw):
    monkeypatch.setattr(loader, "fuses", lambda *a, **k: False)  # keep the weights as the file maps them
    return Llama.build(str(ckpt), str(ckpt / "tokenizer.model"), 64, 1, dtype="bfloat16", compile=False, **kw)


def weight_bytes(model) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.parameters()}
    return sum(storages.values())


@pytest.mark.skipif(not preload.file_mappings(), reason="needs /proc/self/maps (Linux)")
def test_lazy_load_leaves_pages_out_and_read_weights_brings_every_one_in(ckpt, monkeypatch):
    llm = build(ckpt, monkeypatch, preload=False)
    weights = weight_bytes(llm.model)
    assert weights > 4 << 20
    before = smaps_bytes(ckpt / "consolidated.00.pth")
    assert before < weights / 2  # mapped, not read: build() touched no weight
    assert preload.read_weights(llm.model) == weights  # every parameter lies in the mapping, each counted once
    assert smaps_bytes(ckpt / "consolidated.00.pth") >= weights


@pytest.mark.skipif(not preload.file_mappings(), reason="needs /proc/self/maps (Linux)")
def test_build_reads_the_weights_by_default_and_generates_the_same(ckpt, monkeypatch):
    lazy = build(ckpt, monkeypatch, preload=False)
    want = lazy.text_completion(["Once upon"], max_gen_len=8, temperature=0)
    del lazy
    llm = build(ckpt, monkeypatch)
    assert smaps_bytes(ckpt / "consolidated.00.pth") >= weight_bytes(llm.model)
    assert llm.text_completion(["Once upon"], max_gen_len=8, temperature=0) == want


def filesystem(path) -> str:
    """The type of the filesystem holding path, from /proc/mounts (the longest mount point above it)."""
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, point, fs = line.split()[:3]
            if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fs
    return kind


@pytest.mark.skipif(preload._mincore is None or not hasattr(os, "posix_fadvise"), reason="needs mincore (Linux)")
def test_missing_pages_lists_what_the_page_cache_lacks_until_the_weights_are_read(ckpt, tmp_path, monkeypatch):
    if filesystem(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is in memory: its pages cannot be dropped from the page cache")
    write_random_checkpoint(tmp_path, PARAMS, tokenizer_path=ckpt / "tokenizer.model", dtype=torch.bfloat16)
    llm = build(tmp_path, monkeypatch, preload=False)  # its own file: no other test's model maps its pages
    evict(tmp_path / "consolidated.00.pth")  # the weights, mapped but unread
    storages = preload.mapped_storages([*llm.model.parameters()], preload.file_mappings())
    pages = sum(-(-s.nbytes() // mmap.PAGESIZE) for s in storages)
    missing = [preload.missing_pages(s) for s in storages]
    assert all(len(m) == 0 or (0 <= int(m.min()) and int(m.max()) < s.nbytes()) for s, m in zip(storages, missing))
    assert sum(len(m) for m in missing) > pages / 2
    preload.read_weights(llm.model, True)
    assert sum(len(preload.missing_pages(s)) for s in storages) == 0


@pytest.mark.skipif(preload._mincore is None or not hasattr(os, "posix_fadvise"), reason="needs mincore (Linux)")
def test_read_files_puts_the_bytes_behind_the_weights_in_the_page_cache(ckpt, tmp_path, monkeypatch):
    """The first phase of read_weights: the file pieces behind every storage, found from /proc/self/maps, read
    with several requests in flight, into the page cache only (this process's page tables are left as they were)."""
    if filesystem(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is in memory: its pages cannot be dropped from the page cache")
    write_random_checkpoint(tmp_path, PARAMS, tokenizer_path=ckpt / "tokenizer.model", dtype=torch.bfloat16)
    llm = build(tmp_path, monkeypatch, preload=False)
    path = tmp_path / "consolidated.00.pth"
    evict(path)
    storages = preload.mapped_storages([*llm.model.parameters()], preload.file_mappings())
    monkeypatch.setattr(preload, "_PIECE", 64 << 10)  # several pieces per storage, reads at uneven offsets
    pieces = preload.file_pieces(storages, preload.mapped_files())
    assert {p for p, _, _ in pieces} == {str(path.resolve())}
    assert sum(n for _, _, n in pieces) == sum(s.nbytes() for s in storages)
    assert len(pieces) > len(storages)
    assert sum(len(preload.missing_pages(s)) for s in storages) > 0
    mapped = smaps_bytes(path)
    assert preload.read_files(pieces) == sum(s.nbytes() for s in storages)
    assert sum(len(preload.missing_pages(s)) for s in storages) == 0
    assert smaps_bytes(path) <= mapped + (1 << 20)
    with open(path, "rb") as f:  # each piece holds the bytes of the storage it was found for, in order
        at = 0
        for storage in storages:
            data = bytes(preload._bytes(storage).numpy())
            for _, offset, n in pieces[at:]:
                f.seek(offset)
                assert f.read(n) == data[:n]
                at, data = at + 1, data[n:]
                if not data:
                    break
    assert preload.read_files([(str(tmp_path / "gone.pth"), 0, 4096)]) == 0  # a file that cannot be opened: skipped


def test_weights_that_would_not_fit_stay_lazy(ckpt, monkeypatch):
    llm = build(ckpt, monkeypatch, preload=False)
    monkeypatch.setenv("LLAMA_MEMORY_LIMIT", "1M")  # far under the weights
    assert preload.read_weights(llm.model) == 0
    assert preload.read_weights(llm.model, False) == 0


def test_weights_not_in_a_file_are_not_counted(ckpt, monkeypatch):
    llm = Llama.build(str(ckpt), str(ckpt / "tokenizer.model"), 64, 1, dtype="float32", compile=False)
    assert preload.read_weights(llm.model, True) == 0  # cast to fp32: copies in anonymous memory


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_a_bad_preload_value_is_refused_before_loading(ckpt, bad):
    with pytest.raises(ValueError, match="preload must be True, False or None"):
        Llama.build(str(ckpt / "missing"), None, 64, 1, preload=bad)


def test_reader_runs_cut_the_pieces_in_order_into_shares_of_about_equal_bytes():
    pieces = [("a", o, n) for o, n in zip(range(0, 100, 10), [10] * 9 + [3])] + [("b", 0, 50), ("b", 50, 7)]
    runs = preload.reader_runs(pieces, 4)
    assert [p for run in runs for p in run] == pieces  # every piece once, in order
    assert len(runs) == 4
    total, biggest = sum(n for _, _, n in pieces), max(n for _, _, n in pieces)
    assert all(abs(sum(n for _, _, n in run) - total / 4) <= biggest for run in runs)
    assert preload.reader_runs(pieces[:2], 4) == [[pieces[0]], [pieces[1]]]  # fewer pieces than readers
    assert preload.reader_runs([], 4) == []


def huge_mapped_after_touch(path) -> int:
    """FilePmdMapped bytes of a fresh mapping of path once every page of it is in this process's page tables."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        pages = np.frombuffer(m, dtype=np.uint8)[::mmap.PAGESIZE]
        pages.sum()
        del pages  # the map cannot close while an array holds it
        return smaps_bytes(path, "FilePmdMapped")
    finally:
        m.close()


def test_each_reader_streams_its_own_share_in_order_through_its_own_descriptor(tmp_path, monkeypatch):
    """What lets the kernel's readahead see sequential streams: each reader opens its own descriptor and reads
    its share through it with offsets that only go forward, with no gap; every piece is read exactly once."""
    files = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for f in files:
        f.write_bytes(os.urandom(3 << 20))
    monkeypatch.setattr(preload, "_READERS", 4)
    pieces = [(str(f), o, 256 << 10) for f in files for o in range(0, 3 << 20, 256 << 10)]
    streams, current, real_open, real_preadv = [], {}, os.open, os.preadv

    def opened(path, *args, **kwargs):  # a new stream of reads for this thread on this descriptor
        fd = real_open(path, *args, **kwargs)
        current[threading.get_ident(), fd] = []
        streams.append((str(path), current[threading.get_ident(), fd]))
        return fd

    def preadv(fd, buffers, offset):
        current[threading.get_ident(), fd].append(offset)  # KeyError: a descriptor this thread did not open
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "preadv", preadv)
    assert preload.read_files(pieces) == 6 << 20
    assert len(streams) == 4  # one per reader: each share of 6 pieces lies in one file
    assert sorted((path, o) for path, offsets in streams for o in offsets) == sorted((p, o) for p, o, _ in pieces)
    for _, offsets in streams:
        assert len(offsets) == 6 and offsets == list(range(offsets[0], offsets[0] + (6 << 18), 256 << 10))


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_the_file_read_by_read_files_maps_with_2mb_entries_as_after_one_sequential_read(tmp_path, monkeypatch):
    """Pieces read in turn from one descriptor look random to the kernel, which then fills the page cache with
    small folios; each reader streaming its own share lets it keep large ones, as one sequential read does."""
    if filesystem(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is in memory: its pages cannot be dropped from the page cache")
    size, path = 512 << 20, tmp_path / "weights.bin"
    with open(path, "wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(size >> 20):
            f.write(block)
    evict(path)
    with open(path, "rb") as f:  # one reader in order: what this kernel and filesystem do with a sequential read
        while f.read(1 << 20):
            pass
    want = huge_mapped_after_touch(path)
    if want == 0:
        pytest.skip(f"this kernel keeps no large folios for sequential reads on {filesystem(tmp_path)}")
    evict(path)
    monkeypatch.setattr(preload, "_READERS", 4)  # 128 MB each: the kernel takes a few dozen MB to reach 2 MB folios
    pieces = [(str(path), offset, preload._PIECE) for offset in range(0, size, preload._PIECE)]
    assert preload.read_files(pieces) == size
    assert huge_mapped_after_touch(path) >= want / 2
