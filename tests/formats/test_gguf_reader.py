"""Our GGUF reader (llama/formats/gguf_reader.py): gguf's own parse, field for field and tensor for tensor, over a
plain view of the memory map and with arrays cut in one pass; its tensors map the file, and release() drops their
pages."""

import mmap
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED, need

GGUF = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_reader_parses_as_gguf_s_own_and_its_tensors_map_the_file():
    gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files")
    from llama.formats import gguf_file
    ours, theirs = gguf_file.open_reader(need(GGUF)), gguf.GGUFReader(str(GGUF))
    assert list(ours.fields) == list(theirs.fields) and ours.data_offset == theirs.data_offset
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.types, g.data, len(g.parts)) == (f.offset, f.types, f.data, len(f.parts)), name
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(g.parts, f.parts)), name
    assert ours.fields["tokenizer.ggml.merges"].contents() == theirs.fields["tokenizer.ggml.merges"].contents()
    assert ours.fields["tokenizer.ggml.tokens"].contents(7) == theirs.fields["tokenizer.ggml.tokens"].contents(7)
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset) for t in theirs.tensors]
    first = ours.tensors[0].data
    assert np.array_equal(first, theirs.tensors[0].data) and not first.flags.owndata and not first.flags.writeable
    statm = Path("/proc/self/statm")
    if statm.exists():  # release() still drops the pages it read from this process's resident set
        resident = lambda: int(statm.read_text().split()[1]) * mmap.PAGESIZE  # noqa: E731
        for t in ours.tensors:  # one byte of every page: all of them resident
            t.data.reshape(-1).view(np.uint8)[:: mmap.PAGESIZE].sum()
        before = resident()
        gguf_file.release(ours, ours.tensors)
        assert before - resident() > 0.8 * sum(int(t.n_bytes) for t in ours.tensors)


def test_the_readers_array_fields_of_every_item_type_parse_as_gguf_s_own(tmp_path):
    """Our reader cuts arrays in one pass (a vocabulary in a fraction of the time): every scalar type, strings
    (empty and multi-byte ones) and a nested array read as gguf's parser reads them."""
    gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files")
    from llama.formats import gguf_file
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["a", "", "héllo ✓", "<|eot|>"] * 3)
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.text", "plain")
    w.add_tensor("x", np.arange(8, dtype=np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    ours, theirs = gguf_file.open_reader(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.types, g.data, len(g.parts)) == (f.offset, f.types, f.data, len(f.parts)), name
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(g.parts, f.parts)), name
        assert g.contents() == f.contents(), name
    assert ours.fields["t.strings"].contents()[2] == "héllo ✓" and ours.fields["t.nested"].contents() == [1, 2, 3]
    assert np.array_equal(ours.tensors[0].data, np.arange(8, dtype=np.float32))
