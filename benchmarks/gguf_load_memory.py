"""Peak RSS of loading a quantized (Q8_0) GGUF file: to bf16, and to int8 weights (quantize="int8"), each in a
fresh process, beside the file size and the loaded model's bytes.

    python benchmarks/gguf_load_memory.py [--dim 2048] [--layers 16] [--vocab 32000] [--workdir DIR]

The file is written once (random weights of that shape, llama.cpp's Q8_0 quantizer from the gguf package) into
--workdir and reused. The file's memory-mapped pages count in RSS while they are read, so the figures are what
the process really holds. Loading is layer by layer: an int8 load never holds the model in full precision.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from harness import print_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import write_meta_gguf  # noqa: E402

from llama.hub.demo import random_state_dict  # noqa: E402
from llama.model import ModelArgs  # noqa: E402

MIB = 2**20
SHARED = Path(__file__).resolve().parents[2] / "shared"

PROBE = """
import json, sys, torch
from llama import Llama
from llama.layers import linear_layers
def hwm():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
base = hwm()
g = Llama.build(sys.argv[1], None, max_seq_len=32, max_batch_size=1, compile=False, dtype="bfloat16",
                quantize=None if sys.argv[2] == "none" else sys.argv[2])
seen, nbytes = set(), 0
for t in list(g.model.parameters()) + list(g.model.buffers()):
    if t.data_ptr() not in seen and "cache" not in str(type(t)):
        seen.add(t.data_ptr()); nbytes += t.numel() * t.element_size()
print(json.dumps({"base": base, "peak": hwm(), "weights": nbytes}))
"""


def measure(path: Path, quantize: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(path), quantize], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gguf_load_memory"))
    a = ap.parse_args()
    params = {"dim": a.dim, "n_layers": a.layers, "n_heads": a.dim // 64, "multiple_of": 256, "norm_eps": 1e-5,
              "vocab_size": a.vocab}
    tokenizer = SHARED / "tokenizers" / "llama2" / "tokenizer.model"
    if a.vocab != 32000 or not tokenizer.is_file():
        sys.exit("needs ../shared/tokenizers/llama2/tokenizer.model and --vocab 32000 (the file's vocabulary)")
    a.workdir.mkdir(parents=True, exist_ok=True)
    path = a.workdir / f"random-{a.dim}x{a.layers}-q8_0.gguf"
    if not path.is_file():
        state = random_state_dict(ModelArgs.from_params(params), seed=0)
        write_meta_gguf(path, state, params, tokenizer, quant="Q8_0")
        del state
    print(f"{path.name}: {path.stat().st_size / MIB:.0f} MiB, torch {torch.__version__}")
    rows = []
    for q in ("none", "int8"):
        m = measure(path, q)
        rows.append({"load": "bf16" if q == "none" else "quantize=int8",
                     "peak RSS - baseline (MiB)": f"{(m['peak'] - m['base']) / MIB:.0f}",
                     "model weights (MiB)": f"{m['weights'] / MIB:.0f}"})
    print_results("gguf-load-memory", rows)


if __name__ == "__main__":
    main()
