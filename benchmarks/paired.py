"""Batch-1 decode (or prefill) against llama.cpp in one process, in alternating blocks: ratios that the machine's
drift cancels.

    python benchmarks/paired.py --model 7b --workdir DIR [--dtypes int4 int8-dynamic] [--blocks 10] [--tokens 8]
                                [--compile off|on|auto] [--prompts 16 64 256] [--layer-by-layer]

bench.py runs each engine in its own process, minutes apart, and on a shared machine the memory bandwidth moves
by a factor of two over minutes (docs/performance-history.md, "At 7B"). Here one process per scheme loads both models,
ours (the `python -m llama.quantize` copy, made as bench.py makes it) and llama.cpp's GGUF (q4_0 / q8_0 from
llama.cpp's own quantizer), then decodes `--tokens` tokens with each in turn, `--blocks` times, the order
alternating. Each block gives one ratio of two rates measured seconds apart. With `--prompts`, each block times
the prefill of a prompt of each length instead (prompt tok/s; llama.cpp evaluates it in batches of 512). Both sets
of weights must fit in memory together. bf16 runs ours on llama.cpp's own bf16 GGUF file, which this package maps in place: both
engines read the same pages, so 7B bf16 needs 13.5 GB, not twice that. `--layer-by-layer` adds ours with the
one-call decode step turned off (`LLAMA_FUSED_DECODE=0`, llama/kernels/fused_decode.py) as a third engine in each block.
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
from bench import prequantize
from harness import (LLAMA2_TOKENIZER, greedy_decoders, machine, print_results, prompt_tokens, read_bandwidth, run_requests,
                     shape_checkpoint)
from peers import gguf_file

from llama import settings

# int4-g64: our int4 with groups of 64, q4_0's 4.5 bits per weight (group 32 is q4_1's size)
GGUF_TYPE = {"bf16": "bf16", "int8-dynamic": "q8_0", "int4": "q4_0", "int4-g64": "q4_0"}


def measure(cfg: dict) -> dict:
    """In a child process: both models loaded, decoded in alternating blocks."""
    import llama_cpp

    from llama import Llama
    from llama.core.frontend.params import SamplingParams

    n, prompt_len, prefill = cfg["tokens"], 16, cfg.get("prompts") or []
    ctx = max([prompt_len + n, *prefill]) + 8
    ours = Llama.build(cfg["ours"], None if cfg["dtype"] == "bf16" else cfg["tokenizer"], max_seq_len=ctx, max_batch_size=1,
                       dtype="bfloat16" if cfg["dtype"] == "bf16" else None, compile={"off": False, "on": True, "auto": "auto"}[cfg["compile"]],
                       quantize="int8-dynamic" if cfg["dtype"] == "int8-dynamic" else None)
    ours.tokenizer.stop_tokens = {}  # random weights: every block decodes n tokens
    peer = llama_cpp.Llama(cfg["gguf"], n_ctx=ctx, n_batch=512, n_threads=torch.get_num_threads(),
                           n_threads_batch=torch.get_num_threads(), verbose=False)
    run_ours, run_peer = greedy_decoders(ours, peer, prompt_tokens(ours.model.vocab_size, prompt_len), n)

    def run_layer_by_layer():
        os.environ["LLAMA_FUSED_DECODE"] = "0"
        settings.reload()  # read once per process otherwise
        try:
            return run_ours()
        finally:
            del os.environ["LLAMA_FUSED_DECODE"]
            settings.reload()

    def prefill_ours(length):  # prompt tok/s: the first step's interval is the prefill and one sample
        times = run_requests(ours, [prompt_tokens(ours.model.vocab_size, length)], SamplingParams(temperature=0, max_gen_len=1))
        return length / (times[1] - times[0])

    def prefill_peer(length):
        peer.reset()
        start = time.perf_counter()
        peer.eval(prompt_tokens(ours.model.vocab_size, length))
        return length / (time.perf_counter() - start)

    run_ours(), run_peer()  # warm both: first passes, thread pools
    blocks = []
    for b in range(cfg["blocks"]):
        engines = (("ours", run_ours, prefill_ours), ("peer", run_peer, prefill_peer))
        if cfg.get("layer_by_layer"):
            engines += (("layers", run_layer_by_layer, None),)
        engines = engines[:: 1 if b % 2 == 0 else -1]
        if prefill:  # one pair per prompt length
            blocks.append({length: {name: pre(length) for name, _, pre in engines if pre} for length in prefill})
        else:
            blocks.append({name: fn() for name, fn, _ in engines})
    return {"blocks": blocks}


HEAD = ["scheme", "ours tok/s, median", "llama.cpp tok/s, median", "ours / llama.cpp, median of blocks", "range",
        "blocks"]


def not_run(label: str, why: str) -> dict:
    """A row of the table for a scheme that gave no figures."""
    return {**dict.fromkeys(HEAD, ""), "scheme": label, HEAD[1]: why}


def report(label: str, blocks: list, seconds: float) -> dict:
    """The table's row for one scheme (or prompt length); every block's rates printed as they come."""
    ratios = [b["ours"] / b["peer"] for b in blocks]
    row = dict(zip(HEAD, [label, f"{statistics.median(b['ours'] for b in blocks):.2f}",
                          f"{statistics.median(b['peer'] for b in blocks):.2f}", f"{statistics.median(ratios):.2f}x",
                          f"{min(ratios):.2f}–{max(ratios):.2f}x", f"{len(blocks)} in {seconds:.0f} s"]))
    print(f"{label}: blocks (ours, llama.cpp tok/s): " + ", ".join(f"{b['ours']:.2f}/{b['peer']:.2f}" for b in blocks),
          flush=True)
    if "layers" in blocks[0]:
        steps = [b["ours"] / b["layers"] for b in blocks]
        print(f"  ours / ours layer by layer (LLAMA_FUSED_DECODE=0): {statistics.median(steps):.3f}x median of blocks, "
              f"{min(steps):.3f}–{max(steps):.3f}x; layer by layer / llama.cpp "
              f"{statistics.median(b['layers'] / b['peer'] for b in blocks):.2f}x; layer-by-layer tok/s: "
              + ", ".join(f"{b['layers']:.2f}" for b in blocks), flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="7b", help="a shape of benchmarks/harness.py, written once into --workdir")
    p.add_argument("--workdir", required=True)
    p.add_argument("--dtypes", nargs="+", default=["int4", "int8-dynamic"], choices=list(GGUF_TYPE))
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--tokens", type=int, default=8, help="tokens decoded per block and engine")
    p.add_argument("--compile", choices=["off", "on", "auto"], default="off",
                   help="ours eager, compiled (the step is stored on disk once compiled), or the default policy")
    p.add_argument("--prompts", type=int, nargs="+", metavar="N",
                   help="time the prefill of prompts of these lengths (prompt tok/s) instead of decoding")
    p.add_argument("--layer-by-layer", action="store_true",
                   help="also time ours with the one-call decode step off (LLAMA_FUSED_DECODE=0) in every block")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.prompts and a.layer_by_layer:
        p.error("--layer-by-layer compares decode steps; prefills (--prompts) run layer by layer either way")
    if a.prompts and min(a.prompts) < 2:
        p.error(f"--prompts: lengths must be at least 2 tokens (BOS and one more), got {min(a.prompts)}")
    if a.measure:
        print("RESULT " + json.dumps(measure(json.loads(a.measure))))
        return
    from llama.loading import memory

    ckpt = Path(a.workdir) / f"random-{a.model}"
    if not (ckpt / "params.json").exists():
        shape_checkpoint(a.model, ckpt)
    print(machine())
    print(f"read bandwidth: {read_bandwidth():.1f} GB/s")
    print(f"command: python benchmarks/paired.py {' '.join(sys.argv[1:])}")
    rows = []
    for dtype in a.dtypes:
        cfg = {"ckpt": str(ckpt), "tokenizer": str(LLAMA2_TOKENIZER), "workdir": a.workdir}
        gguf = gguf_file(cfg, GGUF_TYPE[dtype])
        scheme, _, group = dtype.replace("-dynamic", "").partition("-g")
        ours = str(gguf) if dtype == "bf16" else prequantize(str(ckpt), a.workdir, scheme, int(group) if group else None)
        need = gguf.stat().st_size + sum(f.stat().st_size for f in Path(ours).glob("*.pth"))  # bf16: one file
        have = memory.available_bytes()
        if have is not None and need * memory.MARGIN > have:
            rows.append(not_run(dtype, f"not run: both models need {need / 1e9:.1f} GB, {have / 1e9:.1f} GB available"))
            continue
        cfg.update(dtype=dtype, ours=ours, gguf=str(gguf), blocks=a.blocks, tokens=a.tokens, compile=a.compile,
                   prompts=a.prompts, layer_by_layer=a.layer_by_layer)
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--workdir", a.workdir, "--measure", json.dumps(cfg)],
                              capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            rows.append(not_run(dtype, f"failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"))
            continue
        blocks = json.loads(line[len("RESULT "):])["blocks"]
        if a.prompts:
            for length in a.prompts:
                rows.append(report(f"{dtype}, prefill {length}", [b[str(length)] for b in blocks],
                                   time.perf_counter() - t))
        else:
            rows.append(report(dtype, blocks, time.perf_counter() - t))
    print_results("paired-llamacpp", rows)


if __name__ == "__main__":
    main()
