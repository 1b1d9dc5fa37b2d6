"""Total time of a generation, compile time included, for compile=False / True / "auto" (Llama.build's default).

    python benchmarks/bench_compile_auto.py --model 110m --dtype bf16 --gen 64 1024 4096

"auto" decodes eagerly until that has cost the expected compile time, then compiles: short generations should
cost what eager costs, long ones approach compiled speed, and no case more than about twice the better of the
two. Each (compile, length) runs in a fresh process (no compiled graph carried over; Inductor's on-disk caches
are, as for a user). Random weights of a bench.py shape, written to a temporary directory.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common import LLAMA2_TOKENIZER, SHAPES, prompt_tokens, run_requests, shape_checkpoint


def worker(cfg: dict) -> dict:
    from llama import Llama
    from llama.params import SamplingParams

    compile_arg = {"False": False, "True": True, "auto": "auto"}[cfg["compile"]]
    llm = Llama.build(cfg["ckpt"], cfg["tokenizer"], max_seq_len=16 + cfg["gen"], max_batch_size=1,
                      dtype=cfg["dtype"], compile=compile_arg)
    llm.tokenizer.stop_tokens = {}  # random weights: decode every requested token
    times = run_requests(llm, [prompt_tokens(llm.model.vocab_size, 16)], SamplingParams(temperature=0,
                                                                                           max_gen_len=cfg["gen"]))
    step = llm.runner.compiled
    return {"seconds": times[-1] - times[0], "compiled": bool(step and step.seen),
            "compile_s": max(step.seen.values()) if step and step.seen else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="110m", choices=list(SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--gen", nargs="+", type=int, default=[64, 1024, 4096])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="llama-bench-"))
    try:
        ckpt = shape_checkpoint(args.model, tmp / args.model)
        print(f"model {args.model} {args.dtype}, batch 1, prompt 16; total seconds of the generation (compile included)")
        print("| tokens | compile=False | compile=True | compile=\"auto\" | auto vs the better of the two |")
        print("|---|---|---|---|---|")
        for gen in args.gen:
            res = {}
            for comp in ("False", "True", "auto"):
                cfg = dict(ckpt=str(ckpt), tokenizer=str(LLAMA2_TOKENIZER), gen=gen, dtype=args.dtype, compile=comp)
                proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True,
                                      text=True)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if not line:
                    raise SystemExit(f"{cfg}: {proc.stderr[-2000:]}")
                res[comp] = json.loads(line[0][len("RESULT "):])
            best = min(res["False"]["seconds"], res["True"]["seconds"])
            auto = res["auto"]
            note = f" (compiled; {auto['compile_s']:.0f} s of it compiling)" if auto["compiled"] else " (stayed eager)"
            print(f"| {gen} | {res['False']['seconds']:.1f} | {res['True']['seconds']:.1f} "
                  f"(compile {res['True']['compile_s']:.0f}) | {auto['seconds']:.1f}{note} | "
                  f"{auto['seconds'] / best:.2f}x |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
