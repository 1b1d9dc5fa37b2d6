"""gguf's GGUF reader, made faster where this package's loads spend their time (parsing the metadata), in a module
of its own so that `import llama` does not import gguf (0.8 s with the mistral_common it imports) until a file is
read (llama/formats/gguf_file.py open_reader)."""

import gguf
import numpy as np


class Reader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map. Its parser slices the map once per value (a few
    per vocabulary string: several hundred thousand for a Llama 3 file), and every slice of an `np.memmap` runs
    the subclass's `__array_finalize__`; over a plain view the same parse takes about a third of the time.
    Tensors still map the file's bytes; `memmap` keeps the map itself (`release` advises the kernel on it)."""

    @property
    def data(self):
        return self._plain

    @data.setter
    def data(self, value):
        self.memmap, self._plain = value, value.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """An array's parts as gguf's own parser lays them out (the item type, the length, then each item's parts,
        `data` indexing the values), cut in one pass instead of one recursive call and several numpy calls per
        item: a 151,936-string vocabulary took gguf-py seconds (about 19 s on a busy 2-core machine), now a
        fraction of one. Other fields, and files in the other byte order, take gguf's own path."""
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n, offs = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        parts, data = [raw_itype, alen], []
        if itype == gguf.GGUFValueType.STRING:
            buf = self._plain
            lengths = memoryview(buf)
            for _ in range(n):
                size = int.from_bytes(lengths[offs:offs + 8], "little")
                data.append(len(parts) + 1)
                parts += (buf[offs:offs + 8].view(np.uint64), buf[offs + 8:offs + 8 + size])
                offs += 8 + size
        elif itype in self.gguf_scalar_to_np:
            values = self._get(offs, self.gguf_scalar_to_np[itype], n)
            data = list(range(len(parts), len(parts) + n))
            parts += list(values.reshape(n, 1)) if n else []
            offs += int(values.nbytes)
        else:  # nested arrays: gguf's general parser
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, parts, data, [gguf.GGUFValueType.ARRAY] + ([itype] if n else [])
