"""CPU time of one-row GGUF block products per format (llama/kernels/csrc/gguf_blocks.cpp), for comparing two
checkouts on a busy machine, where wall times (benchmarks/gguf_kernels.py) swing several-fold with other work.

    PYTHONPATH=CHECKOUT python benchmarks/gguf_cpu_time.py [Q4_0 Q4_K ...]

One thread; per format, 3 random-block 4096x4096 weights (tests/gguf_blocks_data.py) times one activation row,
12 products a repetition, process CPU time per product in ms, the least of 5 repetitions. Prints one JSON line.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gguf_blocks_data import random_blocks  # noqa: E402

from llama.kernels import cpu  # noqa: E402

FORMATS = ["Q4_0", "IQ4_NL", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS"]


def main() -> None:
    import gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("formats", nargs="*", default=FORMATS, metavar="FORMAT",
                   help=f"GGML type names (default: {' '.join(FORMATS)})")
    formats = p.parse_args().formats
    if not cpu.available():
        raise SystemExit("our CPU kernels are not built here")
    torch.set_num_threads(1)
    out = {}
    for kind in formats:
        ws = [torch.from_numpy(random_blocks(kind, 4096, 4096, seed=s)) for s in range(3)]
        x, qt = torch.randn(1, 4096), int(gguf.GGMLQuantizationType[kind])
        for w in ws:
            cpu.gguf_linear(x, w, qt)
        times = []
        for _ in range(5):
            start = time.process_time()
            for _ in range(4):
                for w in ws:
                    cpu.gguf_linear(x, w, qt)
            times.append((time.process_time() - start) / 12 * 1e3)
        out[kind] = round(min(times), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
