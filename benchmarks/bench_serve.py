"""Load test of the OpenAI-compatible server (python -m llama.serve): N concurrent streaming clients.

    python benchmarks/bench_serve.py [--ckpt_dir ../shared/models/stories260K] [--clients 64] [--duration 60]
        [--max_batch_size 16] [--max_seq_len 512] [--threads 1]

Starts the server on a free port, runs `--clients` clients for `--duration` seconds, each sending streamed
completions one after another (mixed lengths: max_tokens drawn from 8..256, seeded sampling, a different seed per
request). Every request gets a unique seed and is checked afterwards: its streamed text must equal what
`Llama.text_completion` gives offline for the same prompt, seed and parameters (so nothing was lost, duplicated or
mixed up between streams). Reports requests, p50/p99 time to first token, and generated tokens per second.
"""

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("LLAMA_SHARED") or REPO.parent / "shared") / "models" / "stories260K"
PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog", "One day, a girl named Sue",
           "Tom had a red ball", "The sun was shining and", "In a small house there lived", "Max wanted to fly"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "llama.serve", "--ckpt_dir", str(args.ckpt_dir), "--port", str(port),
           "--max_batch_size", str(args.max_batch_size), "--max_seq_len", str(args.max_seq_len),
           "--max-queue", str(args.clients), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env)
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit("the server exited")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    sys.exit("the server did not start")


async def client(http, url: str, job_ids, deadline: float, rng: random.Random, results: list) -> None:
    import httpx

    while time.perf_counter() < deadline:
        rid = next(job_ids)
        prompt, max_tokens = rng.choice(PROMPTS), rng.choice([8, 16, 32, 64, 128, 256])
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95, "seed": rid,
                "stream": True, "stream_options": {"include_usage": True}}
        start, ttft, text, usage, done = time.perf_counter(), None, [], None, False
        try:
            async with http.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    results.append({"id": rid, "error": f"HTTP {resp.status_code}: {await resp.aread()!r}"})
                    continue
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        raise RuntimeError(obj["error"]["message"])
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for ch in obj["choices"]:
                        if ch["text"] and ttft is None:
                            ttft = time.perf_counter() - start
                        text.append(ch["text"])
        except (httpx.HTTPError, RuntimeError) as e:
            results.append({"id": rid, "error": repr(e)})
            continue
        results.append({"id": rid, "prompt": prompt, "max_tokens": max_tokens, "text": "".join(text), "ttft": ttft,
                        "tokens": usage["completion_tokens"] if usage else 0, "done": done,
                        "latency": time.perf_counter() - start})


async def load(args, url: str):
    import itertools

    import httpx

    results: list = []
    ids = itertools.count()
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        start = time.perf_counter()
        deadline = start + args.duration
        await asyncio.gather(*(client(http, url, ids, deadline, random.Random(i), results) for i in range(args.clients)))
        wall = time.perf_counter() - start
    return results, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt_dir", default=str(STORIES))
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max_batch_size", type=int, default=16)
    p.add_argument("--max_seq_len", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    port = free_port()
    proc = start_server(args, port)
    try:
        results, wall = asyncio.run(load(args, f"http://127.0.0.1:{port}/v1/completions"))
    finally:
        proc.terminate()
        proc.wait()
    ok = [r for r in results if "error" not in r]
    errors = [r for r in results if "error" in r]
    ids = [r["id"] for r in results]
    assert len(ids) == len(set(ids)), "a request id was answered twice"

    # the offline reference: the same prompts, seeds and parameters through text_completion
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    from llama import Llama

    tok = Path(args.ckpt_dir) / "tokenizer.model"
    gen = Llama.build(str(args.ckpt_dir), str(tok) if tok.exists() else None, max_seq_len=args.max_seq_len,
                      max_batch_size=args.max_batch_size)
    ref = gen.text_completion([r["prompt"] for r in ok], temperature=0.8, top_p=0.95,
                              max_gen_len=[r["max_tokens"] for r in ok], seed=[r["id"] for r in ok]) if ok else []
    mismatched = [r["id"] for r, e in zip(ok, ref) if r["text"] != e["generation"]]
    unfinished = [r["id"] for r in ok if not r["done"]]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    tokens = sum(r["tokens"] for r in ok)

    def pct(q):
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1e3 if ttfts else float("nan")

    print(f"{args.clients} streaming clients for {wall:.1f} s on {args.ckpt_dir} (max_batch_size "
          f"{args.max_batch_size}, max_seq_len {args.max_seq_len})")
    print(f"requests: {len(results)} ({len(ok)} ok, {len(errors)} errors, {len(unfinished)} without [DONE])")
    print(f"replies equal to their offline result: {len(ok) - len(mismatched)}/{len(ok)}")
    print(f"time to first token: p50 {pct(0.5):.1f} ms, p99 {pct(0.99):.1f} ms; "
          f"mean latency {statistics.mean(r['latency'] for r in ok) if ok else float('nan'):.2f} s")
    print(f"generated tokens: {tokens} ({tokens / wall:.1f} tokens/s)")
    for r in errors[:5]:
        print("error:", r["error"])
    by_id = {r["id"]: (r, e) for r, e in zip(ok, ref)}
    for rid in mismatched[:3]:
        r, e = by_id[rid]
        alone = gen.text_completion([r["prompt"]], temperature=0.8, top_p=0.95, max_gen_len=r["max_tokens"],
                                    seed=[rid])[0]["generation"]
        cut = next((i for i, (a, b) in enumerate(zip(r["text"], e["generation"])) if a != b), None)
        print(f"mismatch: request {rid} ({r['prompt']!r}, max_tokens {r['max_tokens']}): differs from the batched "
              f"offline text at character {cut}; the offline text of the request alone "
              f"{'equals the server' if alone == r['text'] else 'equals the batch' if alone == e['generation'] else 'differs from both'}")
        print("  server: ", repr(r["text"][max(0, (cut or 0) - 40):(cut or 0) + 40]))
        print("  offline:", repr(e["generation"][max(0, (cut or 0) - 40):(cut or 0) + 40]))
    if mismatched or errors or unfinished:
        sys.exit(f"FAILED: {len(mismatched)} mismatched, {len(errors)} errors, {len(unfinished)} unfinished")


if __name__ == "__main__":
    main()
