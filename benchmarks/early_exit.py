"""Draft models made from a GGUF model itself, for benchmarking draft-model speculation on real weights where no
small model with its vocabulary is at hand (benchmarks/speculative.py `draft`):

- early exit (LayerSkip-style, untrained): the first N blocks, then the model's own final norm and output, written
  with the gguf package ("firstN"); or any blocks kept, the rest skipped (Draft & Verify's self-speculation,
  "keep0-9,20-29"), renumbered in order;
- the whole model requantized lower by llama.cpp's quantizer (benchmarks/gguf_agreement.py `make`).

Both are written once into the cache directory (llama.settings.cache_dir()/drafts), never next to the source.
"""

from pathlib import Path
from typing import List, Optional

import gguf
from tqdm import tqdm


def _blocks_key(reader: gguf.GGUFReader) -> str:
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    return gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)


def _blocks(spec: str) -> List[int]:
    """"first8" -> 0..7; "keep0-9,20-29" -> those blocks."""
    if spec.startswith("first"):
        return list(range(int(spec[len("first"):])))
    out: List[int] = []
    for part in spec[len("keep"):].split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return sorted(set(out))


def truncate(src: Path, spec: str, out_dir: Optional[Path] = None) -> Path:
    """src with only the transformer blocks spec names (plus embeddings, final norm and output), cached."""
    from llama.settings import cache_dir

    src = Path(src)
    out = (Path(out_dir) if out_dir else cache_dir() / "drafts") / f"{src.stem}.{spec}.gguf"
    if out.exists():
        return out
    reader = gguf.GGUFReader(src)
    key = _blocks_key(reader)
    total = int(reader.fields[key].contents())
    blocks = _blocks(spec)
    if not blocks or blocks[0] < 0 or blocks[-1] >= total:
        raise ValueError(f"{spec!r} must name blocks in 0..{total - 1} (the blocks of {src.name})")
    new = {b: i for i, b in enumerate(blocks)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    writer = gguf.GGUFWriter(tmp, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():  # as gguf's own gguf_new_metadata.py copies them
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = len(blocks) if field.name == key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)

    def renamed(name: str) -> Optional[str]:
        if not name.startswith("blk."):
            return name
        _, b, rest = name.split(".", 2)
        return f"blk.{new[int(b)]}.{rest}" if int(b) in new else None

    tensors = [t for t in reader.tensors if renamed(t.name) is not None]
    for t in tensors:
        writer.add_tensor_info(renamed(t.name), t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tqdm(tensors, desc=f"writing {out.name}", leave=False):
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.rename(out)
    return out


def draft_file(src: Path, spec: str) -> Path:
    """A draft of src by spec: "firstN" (early exit after N blocks), "keepA-B,C-D" (those blocks) or a llama.cpp
    ftype such as "Q2_K"."""
    if spec.startswith(("first", "keep")):
        return truncate(src, spec)
    from benchmarks.gguf_agreement import make

    return make(Path(src), spec)
