"""Total time of a generation, compile time included, for compile=False / True / "auto" (Llama.build's default).

    python benchmarks/bench_compile_auto.py --model 110m --dtype bf16 --gen 64 1024 4096
    python benchmarks/bench_compile_auto.py --model 110m --dtype fp32 --gen 64 --compare llamacpp

"auto" decodes eagerly until that has cost the expected compile time, then compiles: short generations should
cost what eager costs, long ones approach compiled speed, and no case more than about twice the better of the
two. Each (compile, length) runs in a fresh process, in the order False, True, "auto": compiled steps are kept on
disk (llama/compilation/step_store.py, in $LLAMA_CACHE as for a user), so "auto" finds the step True compiled and loads it
at once, and True itself loads a step an earlier run of this benchmark stored (the table says which). Seconds
are from the request to its last token (prefill, decoding and any compile or load of the step); model loading is
reported apart. --compare llamacpp adds llama.cpp on the same weights (GGUF f32/bf16), also a fresh process.
Random weights of a bench.py shape (seed 0, so every run has the same weights), in a temporary directory.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import LLAMA2_TOKENIZER, SHAPES, print_results, prompt_tokens, run_requests, shape_checkpoint, step_times


def worker(cfg: dict) -> dict:
    from llama import Llama
    from llama.core.frontend.params import SamplingParams

    if cfg["compile"] == "llamacpp":
        return llamacpp_worker(cfg)
    compile_arg = {"False": False, "True": True, "auto": "auto"}[cfg["compile"]]
    start = time.perf_counter()
    llm = Llama.build(cfg["ckpt"], cfg["tokenizer"], max_seq_len=16 + cfg["gen"], max_batch_size=1,
                      dtype=cfg["dtype"], compile=compile_arg)
    load_s = time.perf_counter() - start
    llm.tokenizer.stop_tokens = {}  # random weights: decode every requested token
    times = run_requests(llm, [prompt_tokens(llm.model.vocab_size, 16)], SamplingParams(temperature=0,
                                                                                           max_gen_len=cfg["gen"]))
    step = llm.runner.compiled
    return {"seconds": times[-1] - times[0], "compiled": bool(step and step.seen), "load_s": load_s,
            "compile_s": max(step.seen.values()) if step and step.seen else 0.0,
            "loaded": bool(step and step.loaded)}


def llamacpp_worker(cfg: dict) -> dict:
    import llama_cpp
    from peers import gguf_file

    path = gguf_file(dict(cfg, workdir=str(Path(cfg["ckpt"]).parent)), {"fp32": "f32", "bf16": "bf16"}[cfg["dtype"]])
    start = time.perf_counter()
    llm = llama_cpp.Llama(str(path), n_ctx=16 + cfg["gen"] + 8, n_batch=32, n_threads=torch.get_num_threads(),
                          n_threads_batch=torch.get_num_threads(), verbose=False)
    load_s = time.perf_counter() - start
    tokens = llm.generate(prompt_tokens(llm.n_vocab(), 16), top_k=1, temp=0.0, reset=True)
    times = step_times(next(tokens) for _ in range(cfg["gen"]))
    return {"seconds": times[-1] - times[0], "load_s": load_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="110m", choices=list(SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--gen", nargs="+", type=int, default=[64, 1024, 4096])
    ap.add_argument("--compare", nargs="*", default=[], choices=["llamacpp"])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="llama-bench-"))
    try:
        ckpt = shape_checkpoint(args.model, tmp / args.model)
        cpp = "llamacpp" in args.compare
        print(f"model {args.model} {args.dtype}, batch 1, prompt 16; seconds from the request to its last token "
              "(compile or load of the step included), model load in brackets")
        rows = []
        for gen in args.gen:
            res = {}
            for comp in ("False", "True", "auto") + (("llamacpp",) if cpp else ()):
                cfg = dict(ckpt=str(ckpt), tokenizer=str(LLAMA2_TOKENIZER), gen=gen, dtype=args.dtype, compile=comp)
                proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True,
                                      text=True)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if not line:
                    raise SystemExit(f"{cfg}: {proc.stderr[-2000:]}")
                res[comp] = json.loads(line[0][len("RESULT "):])
            best = min(res["False"]["seconds"], res["True"]["seconds"])
            auto, true = res["auto"], res["True"]

            def how(r):
                if not r["compiled"]:
                    return "stayed eager"
                return f"{'loaded a stored step' if r['loaded'] else 'compiled'} in {r['compile_s']:.1f} s"

            row = {"tokens": gen, "compile=False": f"{res['False']['seconds']:.1f} [{res['False']['load_s']:.1f}]",
                   "compile=True": f"{true['seconds']:.1f} [{true['load_s']:.1f}] ({how(true)})",
                   'compile="auto"': f"{auto['seconds']:.1f} [{auto['load_s']:.1f}] ({how(auto)})",
                   "auto vs the better of the two": f"{auto['seconds'] / best:.2f}x"}
            if cpp:
                c = res["llamacpp"]
                row.update({"llama.cpp": f"{c['seconds']:.1f} [{c['load_s']:.1f}]",
                            "llama.cpp / auto": f"{c['seconds'] / auto['seconds']:.2f}x"})
            rows.append(row)
            print(f"{gen} tokens: {json.dumps(res)}", flush=True)
        print_results("compile-auto", rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
