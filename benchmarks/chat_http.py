"""A multi-turn chat over HTTP, the issue's side by side: each turn streams /v1/completions (greedy) with the whole
conversation so far plus a new user line, and the time to its first token is measured; our server
(`python -m llama.serve`) with the prefix cache on and off, and llama-cpp-python's server (`python -m
llama_cpp.server`, which reuses the longest common prefix of its last prompt) on the same GGUF file.

--model is a GGUF file, or a shape of harness.SHAPES ("1b": the random 1.38B) written once to --workdir as a bf16
GGUF with the Llama 2 tokenizer (peers.write_gguf). Servers are started one after another on free ports, each
alone on the machine, with --threads threads.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.harness import LLAMA2_TOKENIZER, SHAPES, print_results, random_checkpoint

LINES = ["Tell me about the sea.", "What lives there?", "And deeper down?", "How do they see?", "What do they eat?",
         "Are they dangerous?", "Tell me about whales.", "How big are they?", "Do they sing?", "Summarize our chat."]


def model_file(args) -> Path:
    """The GGUF to serve: --model itself, or the named shape's random bf16 weights as GGUF (written once)."""
    if args.model not in SHAPES:
        if not Path(args.model).is_file():
            sys.exit(f"--model {args.model!r} is neither a GGUF file nor one of {', '.join(SHAPES)}")
        return Path(args.model)
    from benchmarks.peers import gguf_file

    import torch

    work = Path(args.workdir)
    ckpt = work / f"chat-{args.model}"
    if not (ckpt / "params.json").is_file():
        random_checkpoint(ckpt, SHAPES[args.model], tokenizer=LLAMA2_TOKENIZER, dtype=torch.bfloat16, std=0.02)
    return gguf_file({"workdir": str(work), "ckpt": str(ckpt), "tokenizer": str(LLAMA2_TOKENIZER)}, "bf16")


def turn(url: str, prompt: str, gen: int, ours: bool) -> dict:
    """One streamed completion: time to its first text, its text, and (our server) prompt and cached tokens."""
    import httpx

    body = {"prompt": prompt, "max_tokens": gen, "temperature": 0.0, "stream": True}
    if ours:
        body["stream_options"] = {"include_usage": True}
    start, first, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if choice.get("text") and first is None:
                    first = time.perf_counter()
                text += choice.get("text") or ""
    return {"ttft": (first or time.perf_counter()) - start, "text": text,
            "prompt": usage.get("prompt_tokens"),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def conversation(url: str, args, ours: bool) -> list:
    """args.turns turns, each the conversation so far plus a new user line; this server's own replies."""
    history, out = args.system, []
    for i in range(args.turns):
        history += f"\nUser: {LINES[i % len(LINES)]}\nAssistant:"
        t = turn(url, history, args.gen, ours)
        history += t["text"]
        out.append(t)
    return out


def start_ours(gguf: Path, port: int, args, mode: str) -> subprocess.Popen:
    """python -m llama.serve on the file, one slot (one conversation), --prefix-cache mode."""
    from benchmarks.bench_serve import wait_ready
    from benchmarks.harness import REPO

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "llama.serve", "--ckpt_dir", str(gguf), "--port", str(port), "--max_batch_size", "1",
           "--max_seq_len", str(args.seq), "--dtype", args.dtype, "--prefix-cache", mode, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env)
    wait_ready(proc, f"http://127.0.0.1:{port}/health", "our server")
    return proc


def run(args) -> None:
    from benchmarks.bench_serve import free_port, start_llamacpp

    gguf = model_file(args)
    results = {}
    for mode in args.modes:
        port = free_port()
        proc = start_ours(gguf, port, args, mode)
        try:
            results[f"ours, cache {mode}"] = conversation(f"http://127.0.0.1:{port}", args, ours=True)
        finally:
            proc.terminate()
            proc.wait()
    if args.peer:
        port = free_port()
        proc = start_llamacpp(SimpleNamespace(gguf=gguf, max_seq_len=args.seq, threads=args.threads), port,
                              interrupt=False)
        try:
            results["llama-cpp-python server"] = conversation(f"http://127.0.0.1:{port}", args, ours=False)
        finally:
            proc.terminate()
            proc.wait()
    rows = []
    first = next(iter(results.values()))
    for i in range(args.turns):
        row = {"turn": i + 1, "prompt tokens (ours)": first[i]["prompt"]}
        for name, turns in results.items():
            row[f"{name} TTFT s"] = round(turns[i]["ttft"], 3)
            if turns[i]["cached"] is not None:
                row[f"{name} cached"] = turns[i]["cached"]
        rows.append(row)
    rows.append({"turn": "2-N sum", **{f"{name} TTFT s": round(sum(t["ttft"] for t in turns[1:]), 2)
                                       for name, turns in results.items()}})
    print(f"{args.turns}-turn chat over HTTP on {gguf.name}, {args.gen}-token greedy replies, {args.threads} threads:")
    print_results("chat-http", rows)


def add_parser(sub) -> None:
    c = sub.add_parser("chat-http", help="a multi-turn chat over HTTP: our server and llama-cpp-python's")
    c.add_argument("--model", required=True, help=f"a GGUF file, or a shape ({', '.join(SHAPES)}) made in --workdir")
    c.add_argument("--workdir", default="/tmp/llama-bench")
    c.add_argument("--turns", type=int, default=10)
    c.add_argument("--gen", type=int, default=32, help="tokens per reply")
    c.add_argument("--seq", type=int, default=2048, help="context of each server (max_seq_len, n_ctx)")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--dtype", default="bfloat16", help="our server's --dtype (llama.cpp runs the file's own types)")
    c.add_argument("--system", default="You are a helpful assistant who answers in a few sentences.")
    c.add_argument("--modes", nargs="+", default=["on", "off"], choices=["on", "exact", "off"],
                   help="our server's --prefix-cache runs")
    c.add_argument("--no-peer", dest="peer", action="store_false", help="skip llama-cpp-python's server")
