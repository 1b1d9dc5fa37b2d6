"""Rewrite a Meta-layout checkpoint with another shard count: `python -m llama.reshard IN_DIR OUT_DIR --shards N`.

Loading already works at any world size, but a checkpoint saved with the shard count you run at loads with no
copy at all (each rank maps its own file). Output shards are written one at a time, each built from memory-mapped
slices of the input, so memory stays near one output shard.
"""

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from llama.formats.checklist import verify_checklist
from llama.formats.meta_checkpoint import (
    load_state_dict,
    open_shards,
    read_params,
    with_vocab,
    write_shards,
)
from llama.model import ModelArgs, check_model_parallel

COPIED = ("tokenizer.model",)  # travels with the weights when present


def reshard(in_dir, out_dir, shards: int, verify: bool = False) -> List[Path]:
    """Write IN_DIR's checkpoint to OUT_DIR as `shards` shards; return the files written."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if out_dir.exists() and in_dir.exists() and out_dir.resolve() == in_dir.resolve():
        raise ValueError(f"output directory {out_dir} is the input directory: write to another one")
    params = read_params(in_dir)
    args = ModelArgs.from_params(params)
    if verify:
        verify_checklist(in_dir)
    # Validate everything (head counts, shard shapes, params.json) before writing anything.
    check_model_parallel(with_vocab(args, shards), shards)
    check_model_parallel(open_shards(in_dir, args).args, shards)

    def shard(k: int):
        return load_state_dict(in_dir, args, k, shards)

    extra = {name: in_dir / name for name in COPIED if (in_dir / name).is_file()}
    return write_shards(out_dir, params, shards, shard, extra)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llama.reshard", description=__doc__.splitlines()[0])
    parser.add_argument("in_dir", help="checkpoint directory (params.json + consolidated.XX.pth)")
    parser.add_argument("out_dir", help="new, empty directory for the resharded checkpoint")
    parser.add_argument("--shards", type=int, required=True, help="number of shards (model-parallel size) to write")
    parser.add_argument("--verify", action="store_true", help="check IN_DIR against its checklist.chk first")
    a = parser.parse_args(argv)
    try:
        written = reshard(a.in_dir, a.out_dir, a.shards, verify=a.verify)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} files to {a.out_dir}: {', '.join(p.name for p in written)} and checklist.chk")
    return 0

