"""preload: memory-mapped weights are read into memory at load when they fit, lazily otherwise."""

import mmap
import os

import pytest
import torch

from llama import Llama, loader, preload
from llama.demo import train_demo_tokenizer, write_random_checkpoint

PARAMS = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 64, "norm_eps": 1e-5,
          "vocab_size": 2048}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("preload")
    tok = train_demo_tokenizer(d / "demo.model")
    write_random_checkpoint(d, PARAMS, tokenizer_path=tok, dtype=torch.bfloat16)
    return d


def mapped_rss(path) -> int:
    """Bytes of this process's mappings of this file that are in its page tables (smaps Rss). Other tests' models
    in the same process map files of the same name: only this path counts."""
    want, total, inside = str(path.resolve()), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = len(head) == 6 and head[5].rstrip("\n") == want
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


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
    before = mapped_rss(ckpt / "consolidated.00.pth")
    assert before < weights / 2  # mapped, not read: build() touched no weight
    assert preload.read_weights(llm.model) == weights  # every parameter lies in the mapping, each counted once
    assert mapped_rss(ckpt / "consolidated.00.pth") >= weights


@pytest.mark.skipif(not preload.file_mappings(), reason="needs /proc/self/maps (Linux)")
def test_build_reads_the_weights_by_default_and_generates_the_same(ckpt, monkeypatch):
    lazy = build(ckpt, monkeypatch, preload=False)
    want = lazy.text_completion(["Once upon"], max_gen_len=8, temperature=0)
    del lazy
    llm = build(ckpt, monkeypatch)
    assert mapped_rss(ckpt / "consolidated.00.pth") >= weight_bytes(llm.model)
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
    fd = os.open(tmp_path / "consolidated.00.pth", os.O_RDONLY)
    os.fsync(fd)  # pages still to be written back cannot be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drops the pages no process maps: the weights, unread
    os.close(fd)
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
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    storages = preload.mapped_storages([*llm.model.parameters()], preload.file_mappings())
    monkeypatch.setattr(preload, "_PIECE", 64 << 10)  # several pieces per storage, reads at uneven offsets
    pieces = preload.file_pieces(storages, preload.mapped_files())
    assert {p for p, _, _ in pieces} == {str(path.resolve())}
    assert sum(n for _, _, n in pieces) == sum(s.nbytes() for s in storages)
    assert len(pieces) > len(storages)
    assert sum(len(preload.missing_pages(s)) for s in storages) > 0
    mapped = mapped_rss(path)
    assert preload.read_files(pieces) == sum(s.nbytes() for s in storages)
    assert sum(len(preload.missing_pages(s)) for s in storages) == 0
    assert mapped_rss(path) <= mapped + (1 << 20)
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
