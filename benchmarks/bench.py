"""Prefill and decode speed of llama on this machine, beside transformers and llama.cpp on the same weights.

    python benchmarks/bench.py --model 110m --dtypes fp32 bf16 int8 --compile off on --batch 1 8 32 \
        --compare hf llamacpp
    python benchmarks/bench.py --model ../shared/models/stories260K --accuracy   # int8 vs fp32 agreement
    python benchmarks/bench.py --model 7b --workdir /big/disk/bench7b --dtypes bf16 int8 int4 --prequantized \
        --from-gguf --compile off --batch 1 8 --compare llamacpp   # Llama 2 7B shape; weights written once, reused

--model is a Meta-layout checkpoint directory or a shape name (tiny, 110m, 1b, 7b), for which random weights are
written to --workdir (reused by later runs that name the same directory) or a temporary directory (never into
the repository). --prequantized also writes int8/int4 checkpoints there once (`python -m llama.quantize`;
int8-dynamic loads the int8 one) and loads those, as a user who quantized once would; without it, int8/int4
quantize at load. --from-gguf runs our fp32/bf16 on llama.cpp's GGUF file, so both engines read the same file.
Each configuration runs in a fresh process, so peak RSS and compile state are its own. Per
configuration: load time, peak RSS at the end of loading and over the whole run (also against the size of the
checkpoint files loaded, where they load as they are), prefill tok/s for a P-token prompt, time to first token,
decode tok/s at each batch size (greedy, EOS disabled so every run decodes N tokens), and at batch 1 the weight
bytes streamed per second against the read bandwidth measured in the same run.

Every engine is timed per generated token (llama's decode loop, transformers' streamer, llama.cpp's token
generator): decode tok/s = B / median time between tokens, TTFT = median time to the first token, over --repeat
runs. The machine is shared and noisy: medians resist short stalls, but compare ratios within one run.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import (
    DTYPES,
    LLAMA2_TOKENIZER,
    SHAPES,
    SHARED,
    alternating,
    best_time,
    drop_from_page_cache,
    machine,
    merge_rounds,
    peak_rss,
    print_results,
    prompt_tokens,
    read_bandwidth,
    round_ratios,
    run_requests,
    shape_checkpoint,
    summarize,
    weight_bytes,
    weight_files,
)


# --------------------------------------------------------------------------------------------- one configuration
def run_llama(cfg: dict) -> dict:
    """Measure this package on one (dtype, quantize, compile) configuration."""
    from llama import Llama
    from llama.core.frontend.params import SamplingParams

    P, N, batches, repeat = cfg["prompt"], cfg["gen"], cfg["batch"], cfg["repeat"]
    pre = cfg.get("prequantized")  # a checkpoint written by `python -m llama.quantize`: loads as its scheme
    if cfg.get("from_gguf"):  # llama.cpp's own GGUF file of this precision (written here if missing), mapped in place
        import peers

        pre = str(peers.gguf_file(cfg, GGUF_TYPE[cfg["dtype"]]))
    start = time.perf_counter()
    llm = Llama.build(pre or cfg["ckpt"], None if cfg.get("from_gguf") else cfg["tokenizer"], max_seq_len=P + N,
                      max_batch_size=max(batches),
                      dtype=DTYPES.get(cfg["dtype"]), quantize=cfg["quantize"] if cfg["quantize"] == "int8-dynamic"
                      or not pre else None, group_size=None if pre else cfg.get("group_size"),
                      compile=cfg["compile"])
    out = {"load_s": time.perf_counter() - start, "load_rss": peak_rss()}
    llm.tokenizer.stop_tokens = {}  # random weights: never stop early, every run decodes N tokens
    prompt = prompt_tokens(llm.model.vocab_size, P)
    x = torch.tensor([prompt])
    # Llama.build reads memory-mapped weights into memory when they fit (llama/loading/preload.py), as llama.cpp reads its
    # file at load. Where they do not, the first passes read what the page cache lacks by page faults: pass again
    # until a pass is no faster than the one before, so the figures below are the model's, not the disk's;
    # first_pass_s keeps the cost.
    t = time.perf_counter()
    llm.model(x, 0)
    out["first_pass_s"] = last = time.perf_counter() - t
    for _ in range(4):
        t = time.perf_counter()
        llm.model(x, 0)
        now = time.perf_counter() - t
        if now >= 0.8 * last:
            break
        last = now
    out["prefill_tps"] = P / best_time(lambda: llm.model(x, 0), repeat)

    def run(b, n):
        return run_requests(llm, [prompt] * b, SamplingParams(temperature=0, max_gen_len=n))

    out["compile_s"], out["decode_tps"] = {}, {}
    for b in batches:
        t = time.perf_counter()
        run(b, 3)  # warm-up; compiles this batch size's decode step when compiling
        out["compile_s"][b] = time.perf_counter() - t
        r = summarize([run(b, N) for _ in range(repeat)], b)
        if b == 1:
            out["ttft_ms"] = r["ttft_ms"]
        out["decode_tps"][b] = r["decode_tps"]
    out["weight_bytes"] = weight_bytes(llm.model)
    out["rss"] = peak_rss()
    src = Path(pre or cfg["ckpt"])
    files = src.stat().st_size if src.is_file() else sum(f.stat().st_size for f in src.iterdir() if f.is_file())
    if (pre or not cfg["quantize"]) and out["weight_bytes"] <= files:  # loaded as stored: not widened, not quantized
        out["checkpoint_bytes"] = files
    return out


def run_config(cfg: dict) -> dict:
    if cfg["engine"] == "llama":
        return run_llama(cfg)
    import peers

    return {"hf": peers.run_hf, "llamacpp": peers.run_llamacpp}[cfg["engine"]](cfg)


def spawn(cfg: dict, timeout: float) -> dict:
    """Run one configuration in a fresh process; its result, or {"error": ...}."""
    cmd = [sys.executable, __file__, "--worker", json.dumps(cfg)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {proc.returncode}: {tail}"}


# --------------------------------------------------------------------------------------------- report
def label(cfg: dict) -> str:
    if cfg["engine"] == "llama":
        prec = cfg["quantize"] or cfg["dtype"]
        prec += f"-g{cfg['group_size']}" if cfg.get("group_size") else ""
        state = {False: "eager", "auto": "compile=auto"}.get(cfg["compile"], "compiled")
        source = (" (pre-quantized)" if cfg.get("prequantized")
                  else " (llama.cpp's GGUF)" if cfg.get("from_gguf") else "")
        return f"llama {prec}{source} {state}"
    if cfg["engine"] == "llamacpp":
        return f"llama.cpp {cfg['gguf_type']}"
    return f"transformers {cfg['dtype']}"


GGUF_TYPE = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0", "int8-dynamic": "q8_0", "int4": "q4_0"}


def precision(cfg: dict) -> str:
    if cfg["engine"] == "llamacpp":
        return {"f32": "fp32", "bf16": "bf16", "q8_0": "int8", "q4_0": "int4"}[cfg["gguf_type"]]
    q = cfg.get("quantize")
    return ("int4" if q == "int4" else "int8") if q else cfg["dtype"]


def fmt(v, spec=".1f"):
    return "—" if v is None else format(v, spec)


def report(results, batches, bandwidth: float, rounds: int = 1) -> list:
    """The results table's rows: one per configuration, ratios against peers of the same precision."""
    head = ["configuration", "load s", "load peak RSS GB", "run peak RSS GB", "run peak / checkpoint",
            "prefill tok/s", "TTFT ms"]
    vs_cpp_head = "vs llama.cpp (b=1)" + (": median of the rounds' ratios (each round)" if rounds > 1 else "")
    head += [f"decode b={b} tok/s" for b in batches] + ["GB/s (b=1)", "% of bandwidth", "vs transformers (b=1/8)",
                                                        vs_cpp_head]
    rows = []
    peers = {}
    for cfg, r in results:
        if cfg["engine"] != "llama" and "error" not in r:
            peers[(cfg["engine"], precision(cfg))] = r
    for cfg, r in results:
        if "error" in r:
            rows.append({**dict.fromkeys(head, ""), "configuration": label(cfg), "load s": f"error: {r['error']}"})
            continue
        dec = {int(k): v for k, v in r["decode_tps"].items()}
        gbs = r["weight_bytes"] * dec[batches[0]] / 1e9 if r.get("weight_bytes") and batches[0] == 1 else None
        row = [label(cfg), fmt(r.get("load_s")), fmt(r["load_rss"] / 1e9 if r.get("load_rss") else None, ".2f"),
               fmt(r["rss"] / 1e9 if r.get("rss") else None, ".2f"),
               fmt(r["rss"] / r["checkpoint_bytes"] if r.get("rss") and r.get("checkpoint_bytes") else None, ".2f"),
               fmt(r.get("prefill_tps"), ".0f"), fmt(r.get("ttft_ms"))]
        row += [fmt(dec.get(b)) for b in batches]
        row += [fmt(gbs), fmt(100 * gbs / bandwidth if gbs else None, ".0f")]
        hf, cpp = peers.get(("hf", precision(cfg))), peers.get(("llamacpp", precision(cfg)))
        ratios = "—"
        if cfg["engine"] == "llama" and hf:
            hdec = {int(k): v for k, v in hf["decode_tps"].items()}
            ratios = "/".join(fmt(dec[b] / hdec[b], ".2f") + "x" for b in batches[:2] if b in hdec and b in dec)
        row.append(ratios)
        vs_cpp = "—"
        if cfg["engine"] == "llama" and cpp and 1 in dec:
            vs_cpp = fmt(dec[1] / {int(k): v for k, v in cpp["decode_tps"].items()}[1], ".2f") + "x"
            per_round = round_ratios(r, cpp)
            if len(per_round) > 1:  # each round's two runs were minutes apart: the median of the rounds' own
                # ratios cancels the drift between rounds, which the ratio of the two medians does not
                vs_cpp = (f"{statistics.median(per_round):.2f}x ({', '.join(f'{x:.2f}' for x in per_round)}); "
                          f"medians {vs_cpp}")
        row.append(vs_cpp)
        rows.append(dict(zip(head, row)))
    return rows


def accuracy_rows(acc: dict) -> list:
    """int8_accuracy's report as table rows, one per configuration against fp32."""
    return [{"config": name, "tokens before divergence": ", ".join(map(str, r["tokens_before_divergence"])),
             "max abs logit diff": f"{r['max_abs_logit_diff']:.4g}", "mean abs logit diff":
             f"{r['mean_abs_logit_diff']:.4g}", "teacher-forced argmax agreement":
             f"{100 * r['teacher_forced_argmax_agreement']:.1f}%"}
            for name, r in acc.items() if isinstance(r, dict)]


# --------------------------------------------------------------------------------------------- int8 accuracy
def int8_accuracy(ckpt: str, tokenizer: str, goldens: Path) -> dict:
    """Greedy agreement and logit differences of int8 (bf16 activations), int8-dynamic (fp32 activations) and plain
    bf16 against fp32 on the goldens' prompts (128 tokens each).

    Logits are compared teacher-forced on the fp32 greedy sequence, so one early divergence does not make every
    later position differ; tokens_before_divergence is from free-running greedy decoding.
    """
    from llama import Llama

    prompts = [v["prompt_tokens"] for v in json.loads(Path(goldens).read_text()).values()]
    kw = dict(max_seq_len=256, max_batch_size=len(prompts))
    ref = Llama.build(ckpt, tokenizer, dtype="fp32", **kw)
    ref_out = [ref.generate([p], max_gen_len=128, temperature=0)[0][0] for p in prompts]
    ref_logits = [ref.model(torch.tensor([p + a]), 0)[0] for p, a in zip(prompts, ref_out)]
    scale = float(torch.cat([lg.flatten() for lg in ref_logits]).std())
    report = {"logit_std_fp32": scale}
    for name, extra in (("int8", dict(dtype="bf16", quantize="int8")), ("int8-dynamic", dict(quantize="int8-dynamic")),
                        ("bf16", dict(dtype="bf16"))):
        other = Llama.build(ckpt, tokenizer, **extra, **kw)
        r = {"tokens_before_divergence": [], "max_abs_logit_diff": 0.0}
        diffs, same = [], []
        for p, a, la in zip(prompts, ref_out, ref_logits):
            b = other.generate([p], max_gen_len=128, temperature=0)[0][0]
            r["tokens_before_divergence"].append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
            lb = other.model(torch.tensor([p + a]), 0)[0]
            diffs.append((la - lb).abs().flatten())
            same.append((la.argmax(-1) == lb.argmax(-1)).float())
        d = torch.cat(diffs)
        r.update(max_abs_logit_diff=float(d.max()), mean_abs_logit_diff=float(d.mean()),
                 teacher_forced_argmax_agreement=float(torch.cat(same).mean()))
        report[name] = r
    return report


# --------------------------------------------------------------------------------------------- main
def prequantize(ckpt: str, workdir: str, scheme: str, group_size: int = None) -> str:
    """The `python -m llama.quantize` copy of ckpt in workdir (written once, in a subprocess, and timed)."""
    out = Path(workdir) / f"{Path(ckpt).name}-{scheme}{f'-g{group_size}' if group_size else ''}"
    if not (out / "params.json").exists():
        t = time.perf_counter()
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "llama.quantize", ckpt, str(tmp), "--scheme", scheme, "--no-progress"]
                       + (["--group-size", str(group_size)] if group_size else []),
                       check=True, cwd=Path(__file__).resolve().parents[1])
        tmp.rename(out)
        print(f"wrote the {scheme} checkpoint {out} in {time.perf_counter() - t:.0f} s", flush=True)
    return str(out)


def configs(args, ckpt: str, tokenizer: str):
    base = dict(ckpt=ckpt, tokenizer=tokenizer, prompt=args.prompt, gen=args.gen, batch=args.batch,
                repeat=args.repeat)
    out = []
    for prec in args.dtypes:
        for comp in args.compile:
            compile_arg = {"off": False, "auto": "auto", "on": True if args.compile_mode == "dtype" else args.compile_mode}
            quantized = prec.startswith("int")
            scheme, _, group = prec.partition("-g")  # int4-g64: int4 with groups of 64
            cfg = dict(base, engine="llama", dtype=None if quantized else prec, quantize=scheme if quantized else None,
                       group_size=int(group) if group else None, compile=compile_arg[comp])
            if args.prequantized and quantized:  # int8-dynamic: the int8 codes
                cfg["prequantized"] = prequantize(ckpt, args.workdir, "int8" if prec == "int8-dynamic" else scheme,
                                                  cfg["group_size"])
            elif args.from_gguf and not quantized:
                cfg.update(from_gguf=True, workdir=args.workdir)
            out.append(cfg)
        if "hf" in args.compare and not prec.startswith("int"):
            out.append(dict(base, engine="hf", dtype=prec))
        gguf_type = GGUF_TYPE[prec.partition("-g")[0]]
        if "llamacpp" in args.compare and not any(c.get("gguf_type") == gguf_type for c in out):
            out.append(dict(base, engine="llamacpp", gguf_type=gguf_type, batch=[1], workdir=args.workdir))
    return out


def run_rounds(args, cfgs: list, ckpt: Path) -> list:
    """Every configuration in a fresh process, --rounds times, in alternating order (the machine's drift reaches
    each alike, and none always runs right after the same other one); (cfg, medians over the rounds) each."""
    rounds = [[] for _ in cfgs]
    for i, (cfg, runs) in alternating(list(zip(cfgs, rounds)), args.rounds):
        if args.cold:
            drop_from_page_cache(weight_files(args.workdir, *([] if args.model in SHAPES else [ckpt])))
        runs.append(spawn(cfg, args.timeout))
        print(f"{label(cfg)}{f' (round {i + 1})' if args.rounds > 1 else ''}: {json.dumps(runs[-1])}", flush=True)
    return [(cfg, merge_rounds(runs)) for cfg, runs in zip(cfgs, rounds)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="110m", help="checkpoint directory or shape: " + ", ".join(SHAPES))
    ap.add_argument("--tokenizer", help="tokenizer.model (default: the checkpoint's, else the Llama 2 tokenizer)")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "int8", "int8-dynamic"],
                    choices=["fp32", "bf16", "int8", "int8-dynamic", "int4", "int4-g64", "int4-g128"],
                    help="int8 schemes: see llama/quantization/cli.py; int4: llama/quantization/int4.py (group 32; -g64: "
                         "groups of 64, q4_0's size)")
    ap.add_argument("--prequantized", action="store_true",
                    help="int8/int4: load checkpoints written once into --workdir by python -m llama.quantize")
    ap.add_argument("--from-gguf", action="store_true",
                    help="fp32/bf16: load ours from llama.cpp's GGUF file of that precision (written into --workdir "
                         "once), so both engines read one file: at 7B two 13.5 GB bf16 files do not fit in the page "
                         "cache together")
    ap.add_argument("--cold", action="store_true",
                    help="evict the weights (--workdir's files, --model's, the int4/int8 pack caches) from the page "
                         "cache before each configuration, so every load reads its files from the disk")
    ap.add_argument("--compile", nargs="+", default=["off", "on"], choices=["off", "on", "auto"],
                    help="off: eager; on: compile each batch size up front; auto: Llama.build's default rule")
    ap.add_argument("--compile-mode", default="dtype", choices=["dtype", "max-autotune", "default"],
                    help="Inductor mode for --compile on (dtype: the fastest measured for the model's dtype)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens P")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per decode run N")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (median of steps, best prefill)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times in turn (fresh processes) and report medians, "
                         "with the range of the round-by-round ratios against llama.cpp")
    ap.add_argument("--compare", nargs="*", default=[], choices=["hf", "llamacpp"])
    ap.add_argument("--workdir", help="where random weights and GGUF files go (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    ap.add_argument("--accuracy", action="store_true", help="int8 vs fp32 agreement on the goldens, then exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        sys.path.insert(0, str(Path(__file__).parent))
        print("RESULT " + json.dumps(run_config(json.loads(args.worker))), flush=True)
        return 0
    if args.accuracy:
        ckpt = Path(args.model)
        tok = args.tokenizer or str(ckpt / "tokenizer.model")
        acc = int8_accuracy(str(ckpt), tok, SHARED / "goldens" / "stories260K_greedy.json")
        print(f"against fp32 on the goldens' prompts; fp32 logit std {acc['logit_std_fp32']:.4g}")
        print_results("int8-agreement", accuracy_rows(acc), extra={"report": acc})
        return 0
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.batch[0] != 1:
        args.batch = sorted(set(args.batch) | {1})

    tmp = None
    if args.workdir is None:
        tmp = args.workdir = tempfile.mkdtemp(prefix="llama-bench-")
    try:
        if args.model in SHAPES:
            ckpt = Path(args.workdir) / f"random-{args.model}"
            if not (ckpt / "params.json").exists():
                t = time.perf_counter()
                shape_checkpoint(args.model, ckpt)
                print(f"wrote random {args.model} weights to {ckpt} in {time.perf_counter() - t:.0f} s", flush=True)
        else:
            ckpt = Path(args.model)
        tok = args.tokenizer or (str(ckpt / "tokenizer.model") if (ckpt / "tokenizer.model").exists()
                                 else str(LLAMA2_TOKENIZER))
        bw = [read_bandwidth()]
        print(f"machine: {machine()}\nread bandwidth: {bw[0]:.1f} GB/s", flush=True)
        results = run_rounds(args, configs(args, str(ckpt), tok), ckpt)
        bw.append(read_bandwidth())
        limit = max(bw)
        print(f"\nread bandwidth before/after: {bw[0]:.1f} / {bw[1]:.1f} GB/s; the limit below is {limit:.1f} GB/s")
        print(f"command: python -m benchmarks decode-prefill {' '.join(argv if argv is not None else sys.argv[1:])}")
        print(f"model {args.model}, prompt {args.prompt} tokens, {args.gen} generated, {args.repeat} runs each"
              + (f", medians over {args.rounds} rounds" if args.rounds > 1 else "") + "\n")
        print_results("decode-prefill", report(results, args.batch, limit, args.rounds),
                      extra={"bandwidth": bw, "results": results})
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
