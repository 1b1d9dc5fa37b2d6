"""Where our greedy ids and llama.cpp's part on the same GGUF file (llama-cpp-python, its default fp16 KV cache).

    python benchmarks/gguf_agreement.py [FILE.gguf ...] [--make Q4_K_M Q6_K] [--tokens 64] [--threads 2] [--kv f32]

With no file, the shared SmolLM2-135M-Instruct Q4_1 file; --make also quantizes it with llama.cpp's own quantizer
(llama_model_quantize, into $LLAMA_CACHE/agreement/) to each named type and measures those too. Per prompt (5 plain
text prompts, the same token ids for both engines, no BOS as SmolLM2's file says):
- the first position where the two greedy continuations differ (`-` when all --tokens agree; both stop at EOS);
- teacher-forced agreement: our argmax at each position of llama.cpp's own continuation (one pass over prompt +
  continuation) against the token llama.cpp chose there, counted over the continuation's positions.
Ours runs the file's blocks natively (what Llama.build does on CPU), fp32.
"""

import argparse
import ctypes
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_Q4_1 = REPO.parent / "shared" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["Once upon a time", "The three primary colors are", "def fibonacci(n):",
           "The capital of France is", "In 1905, Albert Einstein published"]


def make(src: Path, ftype: str) -> Path:
    """src requantized by llama.cpp's quantizer to ftype (e.g. Q4_K_M), cached by name."""
    import llama_cpp

    from llama.settings import cache_dir

    out = cache_dir() / "agreement" / f"{src.stem.split('.')[0]}.{ftype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize, params.nthread = True, 1
    tmp = out.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
    tmp.rename(out)
    return out


def peer_greedy(llm, prompt: list, tokens: int, eos: int) -> list:
    """llama.cpp's greedy continuation of prompt, one token at a time after the prompt's batch."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(tokens):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        if tok == eos:
            break
        llm.eval([tok])
    return out


def first_divergence(a: list, b: list):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(path: Path, tokens: int, threads: int, kv: str) -> dict:
    import llama_cpp
    import torch

    from llama import Llama
    from llama.formats import gguf_quants

    torch.set_num_threads(threads)
    gen = Llama.build(str(path), None, max_seq_len=256, max_batch_size=1, compile=False)
    eos = gen.tokenizer.eos_id
    f32 = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if kv == "f32" else {}
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_batch=256, n_threads=threads, logits_all=True, verbose=False,
                          **f32)
    rows, agree, total = [], 0, 0
    for text in PROMPTS:
        prompt = gen.tokenizer.encode(text, bos=False, eos=False)
        theirs = peer_greedy(llm, prompt, tokens, eos)
        ours = gen.generate([prompt], max_gen_len=tokens, temperature=0)[0][0]
        ours = ours + ([eos] if len(ours) < len(theirs) and theirs[len(ours)] == eos else [])
        with gen.cache.hold():
            logits = gen.runner.logits([prompt + theirs])[0]
        pred = logits[len(prompt) - 1 : len(prompt) - 1 + len(theirs)].argmax(-1).tolist()
        same = sum(int(p == t) for p, t in zip(pred, theirs))
        agree, total = agree + same, total + len(theirs)
        rows.append({"prompt": text, "first_divergence": first_divergence(ours, theirs), "tokens": len(theirs),
                     "teacher_forced": f"{same}/{len(theirs)}"})
    return {"file": path.name, "kinds": gguf_quants.summary(gen.model), "prompts": rows,
            "teacher_forced": agree / total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", default=[str(SHARED_Q4_1)])
    p.add_argument("--make", nargs="*", default=[], help="also llama.cpp's quantizations of the first file")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv", choices=["f16", "f32"], default="f16", help="llama.cpp's KV cache type (default: its f16)")
    a = p.parse_args()
    from tqdm import tqdm

    files = [Path(f) for f in a.files] + [make(Path(a.files[0]), t) for t in a.make]
    results = []
    for f in tqdm(files, desc="agreement", unit="file"):
        r = measure(f, a.tokens, a.threads, a.kv)
        results.append(r)
        print(f"\n{r['file']} {r['kinds']}, llama.cpp KV cache {a.kv}: teacher-forced argmax agreement "
              f"{r['teacher_forced']:.1%}")
        print("| prompt | first divergent position | teacher-forced |\n|---|---|---|")
        for row in r["prompts"]:
            d = "-" if row["first_divergence"] is None else row["first_divergence"]
            print(f"| {row['prompt']} | {d} of {row['tokens']} | {row['teacher_forced']} |")
    print("JSON " + json.dumps(results))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
