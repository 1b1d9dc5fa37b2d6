"""GGUF files (llama.cpp's format: weights, hyperparameters, tokenizer and chat template in one file), read with
the `gguf` package and turned into this package's parameters, Meta-named weights and tokenizer.

The architectures of llama/formats/architectures.py are accepted (llama with or without experts, qwen2, phi3,
granite, qwen3, qwen3moe, llama4). Quantized tensors
of any type gguf's numpy code dequantizes are, where they do not run in their own blocks
(llama/formats/gguf_quants.py), dequantized at load, tensor by tensor, to the requested dtype; F32/F16/BF16 are
cast, or, already in the requested dtype, used in place: the
tensor maps the file's bytes (read-only, as Meta checkpoints are memory-mapped), so a bf16 file loads without a
copy. llama.cpp's converter stores llama's q/k rows in Meta's interleaved rotary order already (it undoes Hugging
Face's permutation); qwen2's and phi3's it leaves in Hugging Face's order, and architectures.adapt permutes them.
"""

import json
import math
import mmap
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch
from tqdm import tqdm

from llama.formats import architectures
from llama.formats.meta_checkpoint import save_checkpoint
from llama.tokenizers import huggingface
_GLOBAL = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
           "output.weight": "output.weight"}
_LAYER = {"attn_q.weight": "attention.wq.weight", "attn_k.weight": "attention.wk.weight",
          "attn_v.weight": "attention.wv.weight", "attn_output.weight": "attention.wo.weight",
          "ffn_gate.weight": "feed_forward.w1.weight", "ffn_down.weight": "feed_forward.w2.weight",
          "ffn_up.weight": "feed_forward.w3.weight", "attn_norm.weight": "attention_norm.weight",
          "ffn_norm.weight": "ffn_norm.weight", "attn_q.bias": "attention.wq.bias",
          "attn_k.bias": "attention.wk.bias", "attn_v.bias": "attention.wv.bias",
          "attn_q_norm.weight": "attention.q_norm.weight", "attn_k_norm.weight": "attention.k_norm.weight",
          "ffn_gate_inp.weight": "feed_forward.gate.weight",
          "ffn_gate_shexp.weight": "feed_forward.shared_expert.w1.weight",  # Llama 4's shared expert
          "ffn_down_shexp.weight": "feed_forward.shared_expert.w2.weight",
          "ffn_up_shexp.weight": "feed_forward.shared_expert.w3.weight"}
_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")  # an expert's matrix (architectures.split_experts)
_EXPERT_W = {"gate": "w1", "down": "w2", "up": "w3"}


def find_gguf(path) -> Optional[Path]:
    """The GGUF file `path` names: the file itself, or the one .gguf inside a directory without params.json."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "params.json").exists():
        found = sorted(p for p in path.glob("*.gguf") if not _later_part(p))  # a split file: its first part
        if len(found) > 1:
            raise ValueError(f"{path} holds {len(found)} .gguf files: pass the one to load")
        return found[0] if found else None
    return None


def _open_one(path: Path):
    try:
        from llama.formats.gguf_reader import Reader  # gguf (and the mistral_common it imports) only when reading

        return Reader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:  # the reader's errors for truncated/corrupt files
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from None


class SplitReader:
    """The parts of a split file (`name-00001-of-0000N.gguf`, gguf's `split.*` metadata) read as one: the first
    part's metadata (the others carry only their split keys) and every part's tensors, each mapping its own file."""

    def __init__(self, parts):
        self.parts, self.fields = parts, parts[0].fields
        self.tensors = [t for part in parts for t in part.tensors]


_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def _later_part(path: Path) -> bool:
    m = _SPLIT.match(path.name)
    return m is not None and int(m.group(2)) != 1


def open_reader(path: Path):
    """gguf's reader of the file, or a SplitReader over every part when it is the first part of a split file."""
    reader = _open_one(path)
    count = reader.fields.get("split.count")
    if count is None or int(count.contents()) <= 1:
        return reader
    count = int(count.contents())
    m = _SPLIT.match(Path(path).name)
    if m is None or int(m.group(2)) != 1:
        raise ValueError(f"{path} is a part of a file split in {count}: pass its first part (...-00001-of-"
                         f"{count:05d}.gguf)")
    parts = [reader]
    for i in range(2, count + 1):
        part = Path(path).with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf")
        if not part.exists():
            raise ValueError(f"{path}: part {i} of {count} ({part.name}) is missing")
        parts.append(_open_one(part))
    split = SplitReader(parts)
    expected = reader.fields.get("split.tensors.count")
    if expected is not None and int(expected.contents()) != len(split.tensors):
        raise ValueError(f"{path}: its {count} parts hold {len(split.tensors)} tensors, the metadata says "
                         f"{int(expected.contents())}")
    return split


def read_params(reader, path: Path) -> dict:
    """params.json-style hyperparameters from the metadata (llama/formats/architectures.py: the architectures
    and what each changes), the reader's tensors put into the llama layout; refuses what the model cannot run."""
    params = architectures.read_params(reader, path)
    architectures.adapt(reader, path, params)
    return params


def meta_name(name: str, path: Path) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"layers.{parts[1]}.{_LAYER[parts[2]]}"
    expert = _EXPERT.match(parts[2]) if len(parts) == 3 and parts[0] == "blk" else None
    if expert:
        return f"layers.{parts[1]}.feed_forward.experts.{expert.group(2)}.{_EXPERT_W[expert.group(1)]}.weight"
    raise ValueError(f"{path}: tensor {name!r} is not a parameter of the Llama architecture")


def read_state_dict(reader, path: Path, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """Every tensor, Meta-named, dequantized or cast to dtype (a missing output.weight means tied embeddings)."""
    big = sum(int(t.n_bytes) for t in reader.tensors) > 1 << 30
    return read_tensors(tqdm(reader.tensors, desc=f"reading {path.name}", unit="tensor", disable=not big), path, dtype)


_FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def in_place(t, dtype: torch.dtype) -> bool:
    """Whether reader tensor t is used as the file holds it (its type is dtype): no copy, and its pages kept."""
    return _FLOAT.get(t.tensor_type.name) == dtype and t.data.flags.c_contiguous


def mapped_tensor(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The file's bytes of one tensor as a flat torch tensor of dtype, without a copy. The memory map is
    read-only; the model never writes its weights (casting, fusing and quantizing make new tensors)."""
    with warnings.catch_warnings():  # torch warns that the array is not writable: it is the mapped file
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data.reshape(-1).view(np.uint8)).view(dtype)


def read_tensors(tensors, path: Path, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """These reader tensors, Meta-named, dequantized or cast to dtype (in place where they are dtype already)."""
    state = {}
    for t in tensors:
        kind = t.tensor_type.name
        if not readable(kind):
            raise ValueError(f"{path}: tensor {t.name} has type {kind}, which is not supported "
                             f"(supported: {', '.join(supported())})")
        note_dequantized(path, kind)
        shape = tensor_shape(t)
        try:
            values = mapped_tensor(t.data, dtype) if in_place(t, dtype) else dequantize_tensor(t.data, kind, dtype)
        except (ValueError, IndexError, RuntimeError) as e:
            raise ValueError(f"{path}: tensor {t.name} ({kind}) cannot be read (truncated or corrupt?): {e}") from None
        if values.numel() != math.prod(shape):
            raise ValueError(f"{path}: tensor {t.name} ({kind}) holds {values.numel()} values, not {shape}: "
                             "the file is truncated or corrupt")
        state[meta_name(t.name, path)] = values.reshape(shape)
    return state


def supported() -> Tuple[str, ...]:
    """Every tensor type a file may hold: the float types and each block type gguf's numpy code dequantizes."""
    from gguf.quants import _type_traits

    return tuple(sorted({*_FLOAT, *(q.name for q in _type_traits)}))


def readable(kind: str) -> bool:
    return kind in supported()


_noted = set()


def note_dequantized(path: Path, kind: str) -> None:
    """One line per file and block type that is dequantized at load rather than run in its own bits (our kernels run
    llama/quantization/gguf_blocks.py's types on CPU; the others, and any type on a GPU or under quantize=, are
    dequantized)."""
    if kind in _FLOAT or (path, kind) in _noted:
        return
    _noted.add((path, kind))
    print(f"note: {path.name}: {kind} tensors are dequantized at load", file=sys.stderr)


def tensor_shape(t) -> Tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest dimension first


def release(reader, tensors, dtype: Optional[torch.dtype] = None) -> None:
    """Drop these tensors' file pages from this process's resident set once they are read (they stay in the page
    cache and fault back in if touched): loading layer by layer then never holds the whole file too. Tensors
    read in place as dtype keep theirs: they are the weights."""
    if isinstance(reader, SplitReader):
        for part in reader.parts:
            mine = {id(t) for t in part.tensors}
            release(part, [t for t in tensors if id(t) in mine], dtype)
        return
    mm = getattr(getattr(reader, "memmap", reader.data), "_mmap", None)  # numpy.memmap's mmap object
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    for t in tensors:
        if dtype is not None and in_place(t, dtype):
            continue
        start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(int(t.data_offset) + int(t.n_bytes), len(mm))
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            return


def layer_groups(reader, path: Path) -> Tuple[list, Dict[int, list], Dict[str, Tuple[int, ...]]]:
    """(global tensors, {layer: its tensors}, every Meta name -> shape): what a layer-by-layer load reads, and the
    shapes to check before reading anything."""
    globals_, layers, shapes = [], {}, {}
    for t in reader.tensors:
        name = meta_name(t.name, path)
        shapes[name] = tensor_shape(t)
        if name.startswith("layers."):
            layers.setdefault(int(name.split(".")[1]), []).append(t)
        else:
            globals_.append(t)
    return globals_, layers, shapes


def dequantize_tensor(data: np.ndarray, kind: str, dtype: torch.dtype, chunk: int = 1 << 20) -> torch.Tensor:
    """A GGUF tensor's values as a flat torch tensor of dtype, decoded by the gguf package a few rows at a time,
    so the float32 it decodes to never exists for a whole large matrix at once."""
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[kind]
    rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    per_row = rows.shape[1] * rows.itemsize // type_size * block_size
    step = max(1, chunk // max(per_row, 1))
    out = torch.empty(rows.shape[0] * per_row, dtype=dtype)
    for start in range(0, rows.shape[0], step):
        values = np.ascontiguousarray(dequantize(rows[start : start + step], qtype))
        if not values.flags.writeable:  # F32 data is a read-only view of the memory-mapped file
            values = values.copy()
        out[start * per_row : start * per_row + values.size] = torch.from_numpy(values).reshape(-1)
    return out


def load(path, dtype: torch.dtype = torch.float32) -> Tuple[dict, Dict[str, torch.Tensor], object]:
    """(params, full state dict, reader) of a GGUF file."""
    path = Path(path)
    reader = open_reader(path)
    params = read_params(reader, path)
    return params, read_state_dict(reader, path, dtype), reader


def convert(path, out_dir, shards: int = 1, dtype: torch.dtype = torch.float32) -> list:
    """A Meta-layout copy of a GGUF file (`python -m llama.convert gguf`): dequantized weights, params.json, and the
    tokenizer as tokenizer.json + tokenizer_config.json (with the chat template), which load back as tokenizer_path."""
    path = Path(path)
    reader = open_reader(path)
    params = read_params(reader, path)
    tok = huggingface.from_gguf(reader, path)
    state = read_state_dict(reader, path, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        tok.tok.save(str(Path(tmp) / "tokenizer.json"))
        config = {"bos_token": tok.piece(tok.bos_id), "eos_token": tok.piece(tok.eos_id), "add_bos_token": tok.add_bos,
                  "chat_template": tok.chat_template}
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
        extra = {name: Path(tmp) / name for name in ("tokenizer.json", "tokenizer_config.json")}
        return save_checkpoint(state, params, out_dir, shards, extra_files=extra)
