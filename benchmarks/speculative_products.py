"""What one GGUF weight product costs per row count (a verify step's k + 1 rows against a decode step's one), on a
real file's weights: t(M rows) / t(1 row) for each product of the model, every layer's copy in turn (so the
weights stream from memory as in a decode step, not from cache).

  python -m benchmarks.speculative_products [GGUF] [--rows 1-9] [--reps 15] [--threads 1]
  python -m benchmarks.speculative_products --against DIR [--rounds 5]   the same in alternating subprocesses with
                                                        this checkout's llama and with DIR's (another checkout,
                                                        e.g. `git archive BASE llama | tar -x -C DIR`): its kernels
                                                        are built from its own sources, so before and after are
                                                        timed side by side on one machine
  python -m benchmarks.speculative_products --cost ...  also c(k) of a whole verify step (benchmarks.speculative
                                                        cost) in each subprocess

Times are CPU seconds of this process (one thread: the work alone, whatever else the machine runs), medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO.parent / "shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def products(path: str) -> dict:
    """name -> (ggml type, [per-layer (N, row bytes) uint8 weights]) as the model runs them (q/k/v and gate/up
    fused along N, as llama/layers.py fuses them)."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(path)
    by = {t.name: t for t in r.tensors}
    layers = sorted({int(n.split(".")[1]) for n in by if n.startswith("blk.")})
    groups = {"qkv": ["attn_q", "attn_k", "attn_v"], "o": ["attn_output"], "gate_up": ["ffn_gate", "ffn_up"],
              "down": ["ffn_down"]}
    out = {}
    for name, parts in groups.items():
        ts = [[by[f"blk.{i}.{p}.weight"] for p in parts] for i in layers]
        if len({(int(t.tensor_type), np.asarray(t.data).shape[1]) for g in ts for t in g}) > 1:  # mixed types
            for j, part in enumerate(parts):  # (a Q4_K_M file's attn_v, some layers' ffn_down): each part alone
                by_type = {}
                for g in ts:
                    by_type.setdefault(int(g[j].tensor_type), []).append(torch.from_numpy(np.asarray(g[j].data).copy()))
                for qtype, ws in by_type.items():
                    out[f"{part}:{gguf.GGMLQuantizationType(qtype).name}"] = (qtype, ws)
            continue
        out[name] = (int(ts[0][0].tensor_type), [torch.from_numpy(np.concatenate([np.asarray(t.data) for t in g]))
                                                  for g in ts])
    head = by.get("output.weight", by["token_embd.weight"])
    out["output"] = (int(head.tensor_type), [torch.from_numpy(np.asarray(head.data).copy())])
    return out


def time_products(path: str, rows: list, reps: int) -> dict:
    """{product: {M: median CPU seconds of one product of M rows}}: per rep and row count (in a shuffled order),
    every layer's products in the model's order, then the output, each timed alone."""
    import random

    from llama.kernels import cpu
    cpu.available()
    prods = products(path)
    layers = max(len(ws) for _, ws in prods.values())
    times = {p: {m: [] for m in rows} for p in prods}
    g = torch.Generator().manual_seed(0)
    xs = {(p, m): torch.randn(m, cpu.gguf_values(q, ws[0].shape[1]), generator=g)
          for p, (q, ws) in prods.items() for m in rows}
    order = list(rows)
    for _ in range(reps + 1):  # the first a warm-up
        random.shuffle(order)
        for m in order:
            sums = dict.fromkeys(prods, 0.0)
            for i in range(layers):
                for p, (qtype, ws) in prods.items():
                    if i < len(ws):
                        t = time.process_time()
                        cpu.gguf_linear(xs[p, m], ws[i], qtype)
                        sums[p] += time.process_time() - t
            for p in prods:
                times[p][m].append(sums[p] / len(prods[p][1]))
    return {p: {m: statistics.median(v[1:]) for m, v in ts.items()} for p, ts in times.items()}


def time_cost(path: str, reps: int) -> dict:
    """{k: c(k)} of a whole verify step, as benchmarks.speculative cost measures it (CPU time here)."""
    from benchmarks.speculative import verify_ops
    from llama import Llama

    g = Llama.build(path, None, max_seq_len=256, max_batch_size=1, compile=False, prefix_cache="off")
    with g.cache.hold():
        ops = verify_ops(g, range(1, 8))
        times = {k: [] for k in ops}
        for _ in range(reps):
            for k, op in ops.items():
                t = time.process_time()
                g.runner.execute([op])
                times[k].append(time.process_time() - t)
    base = statistics.median(times[0])
    return {0: base, **{k: statistics.median(times[k]) / base for k in range(1, 8)}}


def child(args) -> None:
    import llama

    out = {"products": time_products(args.gguf, args.rows, args.reps), "llama": llama.__file__}
    if args.cost:
        out["cost"] = time_cost(args.gguf, args.reps)
    print("RESULT " + json.dumps(out))


def run_child(pythonpath: str, args) -> dict:
    """One child's results, run with `pythonpath`'s llama first (and there as its working directory)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), args.gguf, "--child", "--reps", str(args.reps),
           "--threads", str(args.threads), "--rows", ",".join(map(str, args.rows))] + (["--cost"] if args.cost else [])
    env = {**os.environ, "PYTHONPATH": f"{pythonpath}:{REPO}"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=pythonpath)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the benchmark under {pythonpath} failed: {done.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def report(name: str, runs: list, rows: list) -> None:
    print(f"== {name} ({len(runs)} runs, llama from {runs[0].get('llama', '?')}; t(1 row) in ms, then t(M rows) / "
          "t(1 row))")
    for p in runs[0]["products"]:
        t = {m: statistics.median(r["products"][p][str(m)] for r in runs) for m in rows}
        print(f"{p:16s} {t[rows[0]] * 1e3:7.3f} ms  " + " ".join(f"{m}:{t[m] / t[rows[0]]:.2f}" for m in rows[1:]))
    if "cost" in runs[0]:
        c = {k: statistics.median(r["cost"][str(k)] for r in runs) for k in range(8)}
        print(f"step     {c[0] * 1e3:7.2f} ms  " + " ".join(f"c({k})={c[k]:.2f}" for k in range(1, 8)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", nargs="?", default=str(SMOLLM2))
    p.add_argument("--rows", default="1-9", help="row counts: 1-9 or 1,2,4,8 (the first is the base)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cost", action="store_true", help="also c(k) of a whole verify step")
    p.add_argument("--against", default=None, metavar="DIR", help="another checkout's llama, timed alternately")
    p.add_argument("--rounds", type=int, default=5, help="with --against: subprocess pairs")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    a, _, b = args.rows.partition("-")
    args.rows = list(range(int(a), int(b) + 1)) if b else [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    if args.child:
        return child(args)
    if not args.against:
        out = {"products": time_products(args.gguf, args.rows, args.reps)}
        if args.cost:
            out["cost"] = time_cost(args.gguf, args.reps)
        return report("this checkout", [json.loads(json.dumps(out))], args.rows)
    from tqdm import tqdm

    runs = {"this checkout": [], args.against: []}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name in runs:
            runs[name].append(run_child(str(REPO) if name == "this checkout" else name, args))
    for name, rs in runs.items():
        report(name, rs, args.rows)


if __name__ == "__main__":
    main()
