"""Batch-1 decode speed of a GGUF file with llama.cpp's arithmetic between the products (LLAMA_GGML_ARITH=1) and
without (our own: the default), each in a fresh process, alternating.

    python benchmarks/gguf_arith.py FILE.gguf [--dtype fp32] [--rounds 3] [--tokens 48]
"""

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "The capital of France is a city that"


def child(path: str, dtype: str, tokens: int) -> dict:
    from llama import Llama

    gen = Llama.build(path, None, max_seq_len=256, max_batch_size=1, compile=False, dtype=dtype)
    prompt = [gen.tokenizer.encode(PROMPT, bos=True, eos=False)]
    gen.generate(prompt, max_gen_len=4, temperature=0)  # warm up
    start = time.perf_counter()
    out = gen.generate(prompt, max_gen_len=tokens, temperature=0)
    return {"tok_s": len(out[0][0]) / (time.perf_counter() - start), "ggml_arith": bool(gen.model.norm.ggml_arith),
            "kv_dtype": str(gen.model.layers[0].attention.cache_k.dtype)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.file, a.dtype, a.tokens)))
        return
    print("| round | LLAMA_GGML_ARITH | tok/s | KV dtype |\n|---|---|---|---|")
    for r in range(a.rounds):
        for arith in (("1", "0") if r % 2 == 0 else ("0", "1")):
            cmd = [sys.executable, __file__, a.file, "--dtype", a.dtype, "--tokens", str(a.tokens), "--child"]
            proc = subprocess.run(cmd, env={**os.environ, "LLAMA_GGML_ARITH": arith}, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(proc.stderr[-3000:])
            m = json.loads(line[len("RESULT "):])
            print(f"| {r + 1} | {arith} | {m['tok_s']:.1f} | {m['kv_dtype']} |", flush=True)


if __name__ == "__main__":
    main()
