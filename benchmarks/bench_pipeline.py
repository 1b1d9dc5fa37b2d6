"""Tensor parallel (T=4) against tensor x pipeline parallel (T=2 x P=2) on one random model, by hand:

    python benchmarks/bench_pipeline.py                        # dim 512, 8 layers, vocab 32000, fp32, CPU/gloo
    python benchmarks/bench_pipeline.py --layouts 4x1 2x2 1x4 --batch 8 --new 64
    python benchmarks/bench_pipeline.py --layouts 2x2 1x2 --prefill_tokens 0   # without the prefill table

For each layout (TxP, 4 processes under torchrun, gloo on CPU) it reports the decode step time (median over the
steps), the bytes the ranks send per generated token, split into what stays inside a stage (tensor-parallel
all-reduces and all-gathers: inside one node in the recommended layout) and what crosses between stages (hidden
states and the sampled tokens or logits: the only traffic between nodes), and each rank's share of the step spent computing
(pipeline stages: compute_s / wall; a stage idles while the others work: these steps run one at a time). Bytes
between stages are given for calls on Llama (the last stage shares sampled tokens) and, in
parentheses, for the engine's path (its rank 0 samples, so the logits travel to the first stage). It also checks
that every layout decodes the same greedy tokens as one process.

Engine table (layouts with pipeline stages): `--engine_batch` requests (the build's max_batch_size) submitted at
once to `Llama.engine()`, with its steps overlapping across the stages (P groups of engine_batch / P slots in
flight, the default) and one step at a time (overlap=False), in the same run: decode tokens per second, each
rank's busy share (compute time inside the stage / wall time), its CPU share (the process's CPU time / wall
time) and CPU milliseconds per generated token, each from a run of `--new` + 1 tokens minus a run of 1 token (so
the prefill cancels out; best of two of each). The last column is what the CPU work alone allows with a free core
per rank: one step at a time the stages take turns (1 / the sum over stages of their CPU time per token),
overlapping they work at once (1 / the slowest stage's); on a shared machine the measured rate is below it.

Bytes are counted where they are sent: point-to-point and broadcast payloads as sent by this rank (the pipeline's
own counters), ring all-reduce as 2 (T-1)/T x the tensor, ring all-gather as (T-1) x the local slice (what NCCL's
and gloo's ring algorithms send per rank). The machine's cores are shared by the 4 ranks, so step times measure the
implementation's overheads on this machine, not a multi-node network: docs/pipeline.md turns the byte counts into
times for real links.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import LLAMA2_TOKENIZER, REPO, machine, print_results, random_checkpoint, step_times

COUNTS = {"tp_bytes": 0, "tp_calls": 0}


def count_collectives(T: int) -> None:
    """Wrap the model's tensor-parallel collectives (llama.model and llama.distributed.parallel) with byte counters."""
    import llama.distributed.parallel as parallel_mod
    import llama.model as model_mod

    def wrap(fn, factor):
        def counted(x):
            COUNTS["tp_bytes"] += int(factor * x.numel() * x.element_size())
            COUNTS["tp_calls"] += 1
            return fn(x)
        return counted

    if T > 1:
        model_mod.reduce_sum = wrap(model_mod.reduce_sum, 2 * (T - 1) / T)
        model_mod.gather_last_dim = wrap(model_mod.gather_last_dim, T - 1)
        parallel_mod.gather_last_dim = wrap(parallel_mod.gather_last_dim, T - 1)


def long_prefill(llm, tokens: int, g) -> dict:
    """Prefill of one long prompt, cut into sequence chunks that the stages work on at once ("chunked"), and in one
    piece ("whole"): (best ms of 3, this rank's busy share then) each; {} for tokens == 0."""
    import torch

    import llama.distributed.pipeline as pipeline_mod

    long_prompt = [1] + torch.randint(3, llm.model.vocab_size, (max(tokens, 2) - 1,), generator=g).tolist()
    prefill = {}
    for name, micro in (("chunked", pipeline_mod.MICRO_TOKENS), ("whole", 10**9)) if tokens else ():
        pipeline_mod.MICRO_TOKENS = micro
        times, busy = [], []
        for _ in range(3):
            c0 = getattr(llm.model, "traffic", {}).get("compute_s", 0.0)
            tic = time.perf_counter()
            llm.generate([long_prompt], max_gen_len=1, temperature=0.0)
            times.append(time.perf_counter() - tic)
            busy.append((getattr(llm.model, "traffic", {}).get("compute_s", 0.0) - c0) / times[-1])
        best = min(range(3), key=times.__getitem__)
        prefill[name] = (1e3 * times[best], busy[best])
    return prefill


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from llama import Llama
    from llama.core.frontend.params import SamplingParams
    from llama.distributed.pipeline import PipelineTransformer, weight_bytes

    torch.set_num_threads(1)
    count_collectives(a.tp)
    llm = Llama.build(a.ckpt, a.tokenizer, max_seq_len=max(a.prompt + a.new + 8, a.prefill_tokens + 8),
                      max_batch_size=max(a.batch, a.engine_batch),
                      model_parallel_size=a.tp, pipeline_parallel_size=a.pp, device="cpu", dtype="float32",
                      compile=False)
    eos = llm.tokenizer.eos_id

    def no_eos(ids, logits):
        logits[eos] = float("-inf")
        return logits

    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, llm.model.vocab_size, (a.prompt - 1,), generator=g).tolist()
               for _ in range(max(a.batch, a.engine_batch))]
    prompts, more = prompts[:a.batch], prompts

    def run(new, leader=False):
        params = SamplingParams(temperature=0.0, max_gen_len=new, logits_processors=[no_eos])
        reqs = llm.inputs.requests(prompts, [params] * len(prompts))
        traffic = getattr(llm.model, "traffic", {})
        before = dict(COUNTS), dict(traffic)
        with llm.cache.hold(), (llm.runner.leader_samples() if leader else contextlib.nullcontext()):
            stamps = step_times(llm.core.run(reqs))
        after = dict(COUNTS), dict(traffic)
        delta = {k: after[0][k] - before[0][k] for k in COUNTS}
        delta.update({k: after[1][k] - before[1][k] for k in traffic})
        return stamps, delta, [r.generated for r in reqs]

    engine = {}
    if a.pp > 1:
        for name, overlap in (("one_step", False), ("overlap", True)):
            engine[name] = engine_decode(llm, more[:a.engine_batch], no_eos, a.new, overlap)
    run(4)  # warm-up
    stamps1, d1, _ = run(1)  # prefill (and the first token) only
    stampsN, dN, tokens = run(a.new + 1)  # the same prefill, then a.new decode steps
    # The engine's path: its rank 0 samples, so the last stage sends it the logits instead of the tokens.
    # (Every rank samples here, as in a static call: ranks other than the first stage's sample from placeholder
    # logits, so only rank 0's tokens mean anything; EOS is banned, so the steps stay the same on every rank.)
    _, e1, _ = run(1, leader=True)
    _, eN, engine_tokens = run(a.new + 1, leader=True)
    steps = [t1 - t0 for t0, t1 in zip(stampsN[1:], stampsN[2:])]
    prefill = long_prefill(llm, a.prefill_tokens, g)
    decode_wall = stampsN[-1] - stampsN[1]
    per_token = {k: (dN[k] - d1[k]) / (a.new * a.batch) for k in dN}
    result = {
        "rank": dist.get_rank(), "step_ms": 1e3 * statistics.median(steps), "decode_wall_s": decode_wall,
        "tp_bytes_per_token": per_token.get("tp_bytes", 0), "pp_bytes_per_token": per_token.get("sent_bytes", 0),
        "engine_pp_bytes_per_token": (eN.get("sent_bytes", 0) - e1.get("sent_bytes", 0)) / (a.new * a.batch),
        "pp_messages_per_step": (dN.get("messages", 0) - d1.get("messages", 0)) / a.new,
        # share of the decode steps' wall time this rank spent computing (run N minus run 1: the decode steps)
        "busy": ((dN["compute_s"] - d1["compute_s"]) / ((stampsN[-1] - stampsN[0]) - (stamps1[-1] - stamps1[0]))
                 if isinstance(llm.model, PipelineTransformer) else None),
        "weight_bytes": weight_bytes(llm.model), "tokens": tokens, "engine_tokens": engine_tokens,
        "prefill": prefill, "engine": engine,
    }
    with open(f"{a.out}.{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def engine_decode(llm, prompts, no_eos, new: int, overlap: bool) -> dict:
    """The prompts submitted at once to the engine on rank 0 (the other ranks serve): decode tokens/s and this
    rank's busy and CPU shares, from a run of new + 1 tokens minus a run of 1 token."""
    import torch.distributed as dist

    runs = []
    for n in (1, new + 1, 1, new + 1):  # twice each, interleaved: the best of each pair (the machine is shared)
        c0, p0 = llm.model.traffic["compute_s"], time.process_time()
        engine = llm.engine(overlap=overlap)
        tokens, wall = None, [0.0]
        if dist.get_rank() == 0:
            tic = time.perf_counter()
            reqs = [engine.submit(p, temperature=0.0, max_gen_len=n, logits_processors=[no_eos]) for p in prompts]
            for r in reqs:
                r.result()  # raises if the request failed
            tokens = [r.generated for r in reqs]
            wall = [time.perf_counter() - tic]
            engine.close()
        else:
            engine.serve_forever()
        dist.broadcast_object_list(wall, src=0)
        runs.append((n, wall[0], llm.model.traffic["compute_s"] - c0, time.process_time() - p0, tokens,
                     engine.stats.get("overlapped", 0)))
    one = min((r for r in runs if r[0] == 1), key=lambda r: r[1])
    full = min((r for r in runs if r[0] > 1), key=lambda r: r[1])
    wall = full[1] - one[1]
    return {"tokens_per_s": len(prompts) * new / wall, "busy": (full[2] - one[2]) / wall,
            "cpu": (full[3] - one[3]) / wall, "cpu_ms_per_token": 1e3 * (full[3] - one[3]) / (len(prompts) * new),
            "tokens": full[4], "overlapped_steps": full[5]}


def launch(a, ckpt: Path, tmp: Path, tp: int, pp: int) -> list:
    out = tmp / f"r{tp}x{pp}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(tp * pp),
           __file__, "--worker", "--ckpt", str(ckpt), "--tokenizer", str(a.tokenizer), "--tp", str(tp), "--pp",
           str(pp), "--batch", str(a.batch), "--engine_batch", str(a.engine_batch), "--prompt", str(a.prompt), "--new", str(a.new), "--out", str(out),
           "--prefill_tokens", str(a.prefill_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLAMA_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{tp}x{pp} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(tp * pp)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=["1x1", "4x1", "2x2"], help="TxP layouts (T tensor, P pipeline)")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--n_layers", type=int, default=8)
    ap.add_argument("--n_heads", type=int, default=8)
    ap.add_argument("--n_kv_heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--engine_batch", type=int, default=64, help="requests in flight in the engine table (its "
                    "max_batch_size): P groups of engine_batch / P")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prefill_tokens", type=int, default=512, help="one prompt this long, prefilled alone "
                    "(0: skip the prefill table)")
    ap.add_argument("--tokenizer", default=str(LLAMA2_TOKENIZER))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    params = dict(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, vocab_size=32000,
                  multiple_of=256)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine()}")
    print(f"# model {params}, fp32; batch {a.batch}, prompt {a.prompt}, {a.new} greedy decode steps; "
          "gloo on CPU, 1 thread per rank")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ckpt = random_checkpoint(tmp / "model", params, tokenizer=Path(a.tokenizer))
        results = {}
        for layout in a.layouts:
            tp, pp = map(int, layout.split("x"))
            results[layout] = launch(a, ckpt, tmp, tp, pp)
    reference = layout_table(results)
    engine_table(results, reference, a.batch)
    if a.prefill_tokens:
        prefill_table(results, a.prefill_tokens)


def layout_table(results: dict) -> list:
    """Decode step and bytes per layout (checking every layout decoded the same tokens); the greedy tokens."""
    reference, rows = None, []
    for layout, ranks in results.items():
        tp, pp = map(int, layout.split("x"))
        reference = reference or ranks[0]["tokens"]
        assert all(r["tokens"] == reference for r in ranks), f"{layout} decoded other tokens"
        assert ranks[0]["engine_tokens"] == reference, f"{layout} decoded other tokens on the engine's path"
        busy = ", ".join(f"{r['busy']:.0%}" for r in ranks) if ranks[0]["busy"] is not None else "n/a"
        rows.append({"layout (T x P)": f"{tp} x {pp}", "ranks": tp * pp,
                     "decode step ms": f"{max(r['step_ms'] for r in ranks):.1f}",
                     "bytes/token inside stages": f"{sum(r['tp_bytes_per_token'] for r in ranks):,.0f}",
                     "bytes/token between stages (engine)": f"{sum(r['pp_bytes_per_token'] for r in ranks):,.0f} "
                     f"({sum(r['engine_pp_bytes_per_token'] for r in ranks):,.0f})",
                     "p2p msgs/step": f"{sum(r['pp_messages_per_step'] for r in ranks):.0f}",
                     "weights/rank MB": f"{max(r['weight_bytes'] for r in ranks) / 1e6:.1f}", "busy per rank": busy})
    print_results("parallel-layouts", rows)
    print("# every layout decoded the same greedy tokens")
    return reference


def engine_table(results: dict, reference: list, batch: int) -> None:
    """The engine's decode, steps one at a time and overlapping, for the layouts with pipeline stages."""
    staged, engine_reference, rows = {k: v for k, v in results.items() if v[0]["engine"]}, None, []
    for layout, ranks in staged.items():
        tp, pp = map(int, layout.split("x"))
        for name, label in (("one_step", "one at a time"), ("overlap", "overlapping")):
            e = [r["engine"][name] for r in ranks]
            engine_reference = engine_reference or e[0]["tokens"]
            assert e[0]["tokens"][:batch] == reference and e[0]["tokens"] == engine_reference, \
                f"{layout} engine ({name}) decoded other tokens"
            ms = [x["cpu_ms_per_token"] for x in e]
            # one at a time, the stages run in turn: sum over stages of the stage's slowest rank; overlapping:
            # the slowest rank
            stages = [max(ms[s * tp:(s + 1) * tp]) for s in range(pp)]
            bound = 1e3 / (sum(stages) if name == "one_step" else max(stages))
            rows.append({"layout (T x P)": f"{tp} x {pp}", "engine steps": label,
                         "decode tokens/s": f"{e[0]['tokens_per_s']:.1f}",
                         "busy per rank": ", ".join(f"{x['busy']:.0%}" for x in e),
                         "CPU per rank": ", ".join(f"{x['cpu']:.0%}" for x in e),
                         "CPU ms per token, per rank": ", ".join(f"{m:.2f}" for m in ms),
                         "tokens/s bound, a free core per rank": f"{bound:.0f}"})
        assert ranks[0]["engine"]["overlap"]["overlapped_steps"] > 0, f"{layout}: no step overlapped"
    if staged:
        print()
        print_results("parallel-layouts-engine", rows)


def prefill_table(results: dict, tokens: int) -> None:
    """One long prompt's prefill per layout, chunked and in one piece."""
    rows = []
    for layout, ranks in results.items():
        cells = []
        for name in ("chunked", "whole"):
            ms = max(r["prefill"][name][0] for r in ranks)
            busy = ", ".join(f"{r['prefill'][name][1]:.0%}" for r in ranks) if ranks[0]["busy"] is not None \
                else "n/a"
            cells.append(f"{ms:.0f} ({busy})")
        rows.append({"layout (T x P)": layout.replace("x", " x "),
                     f"prefill {tokens} tokens, chunked: ms (busy per rank)": cells[0],
                     "in one piece: ms (busy per rank)": cells[1]})
    print()
    print_results("parallel-layouts-prefill", rows)

if __name__ == "__main__":
    main()
