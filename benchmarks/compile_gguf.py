"""Decode speed of one GGUF file eager against compiled (compile=True), fresh processes alternating: what decides
whether compile="auto" should ever compile a GGUF-block model's small batches (LinearMethod.eager_decode).

    python -m benchmarks compile-gguf [FILE] [--rounds 2] [--blocks 3] [--tokens 64]

Each round runs one process per mode (eager first, then compiled, alternately); a process loads the file, decodes a
few tokens (compiling, or loading a stored step, for compile=True: not timed), then times `--blocks` greedy
generations of `--tokens` tokens at batch 1 on every core. FILE defaults to ../shared's SmolLM2 Q4_1.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from harness import print_results

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO.parent / "shared" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"

CHILD = r'''
import json, sys, time
from llama import Llama
path, compiled, blocks, tokens = sys.argv[1], sys.argv[2] == "compiled", int(sys.argv[3]), int(sys.argv[4])
g = Llama.build(path, None, max_seq_len=tokens + 64, max_batch_size=1, compile=compiled)
prompt = ["The history of the Roman Empire is"]
g.text_completion(prompt, max_gen_len=8, temperature=0)
rates = []
for _ in range(blocks):
    start = time.perf_counter()
    g.text_completion(prompt, max_gen_len=tokens, temperature=0)
    rates.append(tokens / (time.perf_counter() - start))
print(json.dumps(rates))
'''


def one(path: Path, mode: str, blocks: int, tokens: int) -> list:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), mode, str(blocks), str(tokens)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} process failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", nargs="?", default=str(DEFAULT))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    rates = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for mode in rates:
            rates[mode] += one(Path(args.file), mode, args.blocks, args.tokens)
    rows = [{"mode": mode, "tok/s mean": f"{statistics.mean(r):.1f}", "tok/s each": " ".join(f"{x:.1f}" for x in r)}
            for mode, r in rates.items()]
    rows.append({"mode": "compiled / eager", "tok/s mean":
                 f"{statistics.mean(rates['compiled']) / statistics.mean(rates['eager']):.2f}x", "tok/s each": ""})
    print_results(f"batch-1 greedy decode of {Path(args.file).name}, eager against compile=True", rows)


if __name__ == "__main__":
    main()
