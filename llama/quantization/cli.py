"""Quantize a checkpoint once, load it in seconds:

    python -m llama.quantize CKPT_DIR OUT_DIR --scheme int8|int4 [--group-size 32] [--shards N]

(--scheme: any storable scheme, llama/quantization/registry.py; --group-size: a grouped one's.)

Reads a Meta-layout checkpoint (any shard count, memory-mapped) and writes a quantized one (llama/formats/quantized_checkpoint.py
describes the files) that Llama.build loads directly: the same logits as quantize= at load, without the minute of
quantizing. It streams: one full-precision tensor at a time is read (its pages released after), quantized and kept;
so peak memory is about the quantized model plus one tensor in fp32. Tokenizer files beside the weights are copied.
"""

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch

from llama.loading import memory
from llama.formats import meta_checkpoint
from llama.formats.quantized_checkpoint import (
    PARAMS_KEY,
    check_groups,
    is_linear,
    quantize_tensor,
    stored_dim,
    stored_scheme,
)
from llama.model import ModelArgs
from llama.quantization import schemes
from llama.quantization.schemes import QuantScheme

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json")


def _split(name: str, t: torch.Tensor, rank: int, shards: int, scheme: QuantScheme) -> torch.Tensor:
    dim = stored_dim(name, scheme)
    if dim is None or shards == 1:
        return t
    size = t.shape[dim] // shards
    return t.narrow(dim, rank * size, size).clone()


def storable(scheme: Union[str, QuantScheme]) -> QuantScheme:
    """The scheme to store by name (or alias), or itself; ValueError unless `python -m llama.quantize` can store it."""
    try:
        found = schemes.lookup(scheme)
    except ValueError:
        found = None
    if found is None or found.storage is None:
        raise ValueError(f"scheme must be one of {schemes.storable()}, got {scheme!r}")
    return found


def quantize_checkpoint(ckpt_dir, out_dir, scheme: Union[str, QuantScheme], group_size: Optional[int] = None,
                        shards: int = 1, progress: bool = True) -> List[Path]:
    """Write the quantized checkpoint of ckpt_dir into out_dir; return the files written."""
    scheme = storable(scheme)
    if scheme.group_size is not None:
        group_size = scheme.check_group_size(scheme.group_size if group_size is None else group_size)
    elif group_size is not None:
        grouped = " or ".join(n for n in schemes.grouped() if n in schemes.storable())
        raise ValueError(f"--group-size applies to --scheme {grouped} only, got {group_size!r} with {scheme.name!r}")
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"shards must be a positive integer, got {shards!r}")
    if stored_scheme(ckpt_dir) is not None:
        raise ValueError(f"{ckpt_dir} is already quantized ({PARAMS_KEY} in its params.json): quantize the "
                         "full-precision checkpoint instead")
    params = meta_checkpoint.read_params(ckpt_dir)
    sset = meta_checkpoint.open_shards(ckpt_dir, ModelArgs.from_params(params))
    args = sset.args
    meta_checkpoint.check_model_parallel(args, shards)
    for name, (n, k) in ((n, s) for n, s in meta_checkpoint.expected_shapes(args).items() if is_linear(n)):
        check_groups(name, k, shards, group_size, f"{shards} shards would cut its groups of {group_size}; choose a "
                     f"shard count whose slices ({k}/shards) are multiples of {group_size}")
    names = list(sset.names)
    if "output.weight" not in names:
        names.append("output.weight")  # tied: quantized from the embedding, written explicitly
        sset.sources["output.weight"] = "tok_embeddings.weight"
    out: List[Dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    bar = _progress(names, progress, f"quantizing to {scheme.name}")
    with memory.freed_memory_returned():  # each tensor's temporaries go back to the OS, not into the heap
        _quantize_all(bar, sset, out, scheme, group_size, shards)
    record = {"scheme": scheme.name, **({"group_size": group_size} if scheme.group_size is not None else {})}
    params = {**params, PARAMS_KEY: record}
    extra = {f: Path(ckpt_dir) / f for f in TOKENIZER_FILES if (Path(ckpt_dir) / f).is_file()}
    return meta_checkpoint.write_shards(out_dir, params, shards, lambda k: out[k], extra)


def _quantize_all(names, sset, out: List[Dict[str, torch.Tensor]], scheme: QuantScheme, group_size: Optional[int],
                  shards: int) -> None:
    """One tensor at a time: read it, quantize it, keep the result, release its source pages."""
    for name in names:
        full = sset.slice(name, 0, 1)
        stored = quantize_tensor(name, full, scheme, group_size) if is_linear(name) else {name: full.clone()}
        del full
        src = sset.sources.get(name, name)
        for shard, mapped in zip(sset.shards, sset.mapped):
            if mapped:  # drop the source pages from this process (read again from the file if needed again)
                meta_checkpoint._release(shard[src])
        for key, t in stored.items():
            for k in range(shards):
                out[k][key] = _split(key, t, k, shards, scheme)


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="tensor", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llama.quantize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--scheme", required=True, choices=schemes.storable())
    grouped = [schemes.get(n) for n in schemes.grouped() if n in schemes.storable()]
    ap.add_argument("--group-size", type=int, default=None,
                    help=", ".join(f"{s.name} only (default {s.group_size})" for s in grouped) or "grouped only")
    ap.add_argument("--shards", type=int, default=1, help="number of consolidated.XX.pth files to write")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    try:
        written = quantize_checkpoint(a.ckpt_dir, a.out_dir, a.scheme, a.group_size, a.shards, not a.no_progress)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in written)
    print(f"wrote {len(written)} files to {a.out_dir} ({size / 1e9:.2f} GB)")
    return 0
