"""Perplexity of one GGUF file by ours and by llama.cpp (llama-cpp-python), on the same token ids and windows.

    python benchmarks/gguf_perplexity.py [FILE.gguf] [--text llama/data/demo_corpus.txt] [--window 512]
        [--stride N] [--threads 2] [--runs 0 3 4]

The text is tokenized once, by our tokenizer (the file's own vocabulary; llama.cpp's ids of the same text are
compared and reported), and cut into windows as `python -m llama.perplexity` cuts them (llama/cli/perplexity.py:
BOS + window - 1 tokens, starting `stride` apart, every token scored once). Rows, each in a fresh process:
- ours, the file's blocks run natively with int8 activations (what Llama.build does on CPU), fp32 and bf16;
- ours, the blocks dequantized to fp32 at load (LLAMA_GGUF_BLOCKS=0: the file's exact weights, fp32 activations);
- llama.cpp on the same file, logits_all=True, each window evaluated from an empty cache; with its default fp16
  KV cache, and with an f32 one (type_k/type_v), which shows what its fp16 keys and values cost.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO.parent / "shared" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def windows_of(cfg: dict, tokenizer) -> tuple:
    from llama.cli.perplexity import windows

    tokens = tokenizer.encode(Path(cfg["text"]).read_text(encoding="utf-8"), bos=False, eos=False)
    stride = cfg["stride"] or max(1, (cfg["window"] - 1) // 2)
    return tokens, windows(len(tokens), cfg["window"], stride), stride


def ours(cfg: dict) -> dict:
    import torch

    from llama import Llama
    from llama.cli.perplexity import perplexity
    from llama.formats import gguf_quants

    torch.set_num_threads(cfg["threads"])
    g = Llama.build(cfg["file"], None, max_seq_len=cfg["window"], max_batch_size=1, dtype=cfg["dtype"],
                    compile=False)
    start = time.perf_counter()
    r = perplexity(g, Path(cfg["text"]).read_text(encoding="utf-8"), stride=cfg["stride"])
    return {**r, "seconds": time.perf_counter() - start, "kinds": gguf_quants.summary(g.model)}


def peer(cfg: dict) -> dict:
    """llama.cpp's log-likelihood of the same ids in the same windows."""
    import llama_cpp
    import numpy as np

    from llama.tokenizers import huggingface
    from llama.formats import gguf_file

    path = Path(cfg["file"])
    tok = huggingface.from_gguf(gguf_file.open_reader(path), path)
    tokens, spans, stride = windows_of(cfg, tok)
    kv = {} if cfg.get("kv") != "f32" else {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}
    llm = llama_cpp.Llama(str(path), n_ctx=cfg["window"], n_batch=cfg["window"], n_threads=cfg["threads"],
                          logits_all=True, verbose=False, **kv)
    text = Path(cfg["text"]).read_text(encoding="utf-8")
    theirs = llm.tokenize(text.encode(), add_bos=False, special=False)
    start, total, count = time.perf_counter(), 0.0, 0
    for b, e, first in spans:
        ids = [tok.bos_id] + tokens[b:e]
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        targets = np.asarray(ids[1:])
        lps = logp[np.arange(len(targets)), targets][first - b :]
        total += float(lps.sum())
        count += len(lps)
    nll = -total / count
    return {"tokens": count, "windows": len(spans), "window": cfg["window"], "stride": stride, "nll": nll,
            "perplexity": math.exp(nll), "seconds": time.perf_counter() - start,
            "same_ids_as_llama_cpp": theirs == tokens}


def child(cfg: dict, env: dict = None) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", nargs="?", default=str(DEFAULT))
    p.add_argument("--text", default=str(REPO / "llama" / "data" / "demo_corpus.txt"))
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", nargs="+", default=None, help="which rows, by index (default: all)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        cfg = json.loads(a.child)
        print(json.dumps(peer(cfg) if cfg["engine"] == "llama.cpp" else ours(cfg)))
        return
    from tqdm import tqdm

    base = {"file": a.file, "text": a.text, "window": a.window, "stride": a.stride, "threads": a.threads}
    rows = [("ours, blocks, fp32", {"engine": "ours", "dtype": "float32"}, {}),
            ("ours, blocks, bf16", {"engine": "ours", "dtype": "bfloat16"}, {}),
            ("ours, dequantized fp32", {"engine": "ours", "dtype": "float32"}, {"LLAMA_GGUF_BLOCKS": "0"}),
            ("llama.cpp", {"engine": "llama.cpp", "dtype": None}, {}),
            ("llama.cpp, f32 KV cache", {"engine": "llama.cpp", "dtype": None, "kv": "f32"}, {})]
    if a.runs:
        rows = [rows[int(i)] for i in a.runs]
    results = []
    for name, cfg, env in tqdm(rows, desc="perplexity", unit="run"):
        results.append((name, child({**base, **cfg}, env)))
    print(f"\n{Path(a.file).name} on {Path(a.text).name}: window {a.window}, {results[0][1]['tokens']} tokens, "
          f"{results[0][1]['windows']} windows (stride {results[0][1]['stride']})\n")
    print("| run | perplexity | mean NLL (nats) | seconds |\n|---|---|---|---|")
    for name, r in results:
        print(f"| {name} | {r['perplexity']:.4f} | {r['nll']:.5f} | {r['seconds']:.1f} |")
    print("JSON " + json.dumps({name: r for name, r in results}))


if __name__ == "__main__":
    main()
