"""Peak RSS of Llama.build on a Llama-3.2-style checkpoint with tied embeddings (no output.weight) against the
same weights with an output.weight of their own: tying must not copy the 128256-row table.

    python benchmarks/tied_memory.py [--dim 2048] [--layers 2]

Random bf16 weights (written to a temporary directory) with Meta's Llama 3 tokenizer from ../shared; each case is
measured in a fresh process (VmHWM after reading every byte of both tables: mapped pages count once read), loaded
in bf16 so no cast copies anything.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from harness import LLAMA3_TOKENIZER, peak_rss, print_results, random_checkpoint

from llama.formats.meta_checkpoint import load_shard, save_checkpoint


def child(ckpt: str) -> dict:
    from llama import Llama

    base = peak_rss()
    g = Llama.build(ckpt, str(LLAMA3_TOKENIZER), max_seq_len=64, max_batch_size=1, dtype="bf16", compile=False)
    m = g.model
    float(m.tok_embeddings.weight.max()) + float(m.output.weight.max())  # page in every byte of both tables
    return {"growth": peak_rss() - base, "shared": m.output.weight.data_ptr() == m.tok_embeddings.weight.data_ptr(),
            "table": m.tok_embeddings.weight.numel() * m.tok_embeddings.weight.element_size()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child)))
        return
    params = {"dim": a.dim, "n_layers": a.layers, "n_heads": a.dim // 64, "n_kv_heads": min(8, a.dim // 64), "multiple_of": 256,
              "rope_theta": 500000.0, "use_scaled_rope": True, "vocab_size": 128256}
    with tempfile.TemporaryDirectory() as tmp:
        untied = random_checkpoint(Path(tmp) / "untied", params, dtype=torch.bfloat16, std=0.02)
        state = load_shard(untied / "consolidated.00.pth")
        del state["output.weight"]
        save_checkpoint(state, params, Path(tmp) / "tied")
        del state
        rows = []
        for name in ("untied", "tied"):
            out = subprocess.run([sys.executable, __file__, "--child", str(Path(tmp) / name)], capture_output=True,
                                 text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"checkpoint": name, "peak RSS growth MiB": round(r["growth"] / 2**20),
                         "embedding table MiB": round(r["table"] / 2**20), "output shares it": r["shared"]})
    print_results("tied-memory", rows)


if __name__ == "__main__":
    main()
