"""Peak RSS of one rank loading a checkpoint: 2 shards at W=1 and W=2, 1 shard at W=2 (and the naive way).

    python benchmarks/load_memory.py [--layers 8] [--dim 1024] [--vocab 32000] [--dtype bfloat16]

Writes a random checkpoint (about 320 MB with the defaults, bf16) in a temporary directory, then measures each
case in a fresh process: VmHWM (peak resident set, /proc/self/status) after the imports and after
`load_state_dict` plus a max over every tensor, which touches every byte a forward pass would read. File-backed
pages of the memory-mapped shards count in RSS, so the figures are what the rank really holds.
"""

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from harness import peak_rss, print_results, random_checkpoint

from llama.formats.meta_checkpoint import expected_shapes, load_state_dict, read_params, shard_paths
from llama.model import ModelArgs

MIB = 2**20


def measure(ckpt: str, rank: int, world: int, naive: bool) -> dict:
    """Run in a child process: peak RSS growth while loading rank `rank` of `world`."""
    args = ModelArgs.from_params(read_params(ckpt))
    torch.zeros(1).sum()  # settle the allocator and kernels before the baseline
    base = peak_rss()
    if naive:  # the reference's way: read this rank's whole shard into RAM (only possible at S == W)
        state = torch.load(shard_paths(ckpt)[rank], map_location="cpu", weights_only=True)
    else:
        state = load_state_dict(ckpt, args, rank, world)
    total = sum(float(t.max()) for t in state.values())  # reads every byte, allocates nothing
    held = sum(t.numel() * t.element_size() for t in state.values())
    return {"peak_growth": peak_rss() - base, "slice": held, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            * 1024, "check": total}


def child(ckpt, rank, world, naive=False) -> dict:
    out = subprocess.run([sys.executable, __file__, "--measure", ckpt, str(rank), str(world)] + (["--naive"] if naive else []),
                         capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--naive", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure[0], int(a.measure[1]), int(a.measure[2]), a.naive)))
        return
    params = {"dim": a.dim, "n_layers": a.layers, "n_heads": a.dim // 64, "n_kv_heads": a.dim // 128,
              "multiple_of": 256, "vocab_size": a.vocab}
    dtype = getattr(torch, a.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        for name, shards in (("s2", 2), ("s1", 1)):  # the same seed: the same weights, sharded two ways
            random_checkpoint(Path(tmp) / name, params, dtype=dtype, std=1.0, shards=shards)
        shapes = expected_shapes(ModelArgs.from_params(params)).values()
        total = sum(math.prod(s) for s in shapes) * dtype.itemsize
        print(f"checkpoint: {params}, {a.dtype}, {total / MIB:.0f} MiB of weights")
        rows = []
        cases = [("2 shards at W=1 (merge)", "s2", 1, False), ("2 shards at W=2 (own shard, mmap)", "s2", 2, False),
                 ("1 shard at W=2 (split)", "s1", 2, False), ("1 shard at W=1", "s1", 1, False),
                 ("2 shards at W=2, naive torch.load", "s2", 2, True)]
        for name, d, world, naive in cases:
            for rank in range(world if not naive else 1):
                r = child(str(Path(tmp) / d), rank, world, naive)
                rows.append({"case": name, "rank": rank, "slice MiB": round(r["slice"] / MIB),
                             "peak RSS growth MiB": round(r["peak_growth"] / MIB)})
    print_results("load-memory", rows)


if __name__ == "__main__":
    main()
