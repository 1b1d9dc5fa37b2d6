"""Load test of the OpenAI-compatible server (python -m llama.serve): N concurrent streaming clients; optionally the
same load against llama-cpp-python's server on the same GGUF weights.

    python benchmarks/bench_serve.py [--ckpt_dir ../shared/models/stories260K] [--clients 64] [--duration 60]
        [--max_batch_size 16] [--max_seq_len 512] [--threads 1] [--no-logprobs] [--dump mismatches.json]
    python benchmarks/bench_serve.py --compare llamacpp [--gguf ../shared/models/smollm2-135m-instruct/...gguf]
        [--threads 2] ...

Starts the server on a free port, runs `--clients` clients for `--duration` seconds, each sending streamed
completions one after another (mixed lengths: max_tokens drawn from 8..256, seeded sampling, a different seed per
request), then lets the requests in flight finish. Reports requests, p50/p99 time to first token, and generated
tokens per second (over the whole wall time, the drain included).

Our server's replies are checked afterwards against `Llama.text_completion` offline for the same prompt, seed and
parameters (so nothing was lost, duplicated or mixed up between streams). Seeded draws are batch-independent
(llama/sample/sampling.py), but the logits are not bit-identical across batch compositions: a matmul over a different
number of rows, a prompt prefilled in two chunks or together with other prompts, rounds differently in the last
bits of float32 (about 1e-6 in log-probability here). Where a seeded draw falls within that rounding of the
boundary between two tokens, the server and the offline batch can pick different tokens, and the texts diverge
from there. So a reply that differs is accepted only when the bench proves it is such a near-tie (this is why
clients ask for the sampled tokens' log-probabilities, `logprobs: 0`; with `--no-logprobs` any difference fails):
- every token before the first differing one is the same, and its log-probability agrees with the offline one to
  within --lp-tol (1e-4 by default; rounding is about 1e-6, while a real error, such as a wrong cache row or
  position, is orders of magnitude larger);
- at the first differing token, drawing the request's seeded number again with llama.sample.sampling.sample from the
  offline logits perturbed by at most --lp-tol (256 random perturbations) gives the server's token at least once.
Anything else (an error, a missing [DONE], a text that differs without such a near-tie) fails the run.
`--dump PATH` writes every differing reply, with its parameters and this analysis, as JSON.

--compare llamacpp: the same load first against our server loaded from `--gguf` (dequantized to float32 by our
loader), then against `python -m llama_cpp.server --model GGUF` with the same context per sequence (--n_ctx =
--max_seq_len) and the same threads (--n_threads and --n_threads_batch = --threads), its other settings as they
are, except --interrupt_requests, run both ways by default (--llamacpp-interrupt): llama-cpp-python's server serves
one completion at a time (one llama_cpp.Llama behind a lock), and by default (interrupt_requests=True) a request
that arrives while another streams ends that stream at once with [DONE] and no finish_reason; with
interrupt_requests=False requests wait their turn, so time to first token grows with the queue. Its replies are
not compared with anything (its sampler is not ours). llama-cpp-python is a benchmark-only dependency (not in any extra):
`pip install 'llama-cpp-python[server]'` (builds llama.cpp from source with cmake; check with --dry-run that it
leaves torch alone).
"""

import argparse
import asyncio
import collections
import itertools
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
SHARED = Path(os.environ.get("LLAMA_SHARED") or REPO.parent / "shared")
STORIES = SHARED / "models" / "stories260K"
SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog", "One day, a girl named Sue",
           "Tom had a red ball", "The sun was shining and", "In a small house there lived", "Max wanted to fly"]
TEMPERATURE, TOP_P = 0.8, 0.95


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, what: str) -> None:
    for _ in range(1500):
        if proc.poll() is not None:
            sys.exit(f"{what} exited")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    sys.exit(f"{what} did not start")


def start_ours(args, ckpt, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "llama.serve", "--ckpt_dir", str(ckpt), "--port", str(port),
           "--max_batch_size", str(args.max_batch_size), "--max_seq_len", str(args.max_seq_len),
           "--max-queue", str(args.clients), "--log-level", "warning"]
    if args.compile is not None:
        cmd += ["--compile", args.compile]
    proc = subprocess.Popen(cmd, env=env)
    wait_ready(proc, f"http://127.0.0.1:{port}/health", "our server")
    return proc


def start_llamacpp(args, port: int, interrupt: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(args.gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", str(args.max_seq_len), "--n_threads", str(args.threads),
           "--n_threads_batch", str(args.threads), "--interrupt_requests", str(interrupt), "--verbose", "False"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    wait_ready(proc, f"http://127.0.0.1:{port}/v1/models", "llama_cpp.server")
    return proc


async def client(http, url: str, job_ids, deadline: float, rng: random.Random, results: list, logprobs: bool) -> None:
    import httpx

    while time.perf_counter() < deadline:
        rid = next(job_ids)
        prompt, max_tokens = rng.choice(PROMPTS), rng.choice([8, 16, 32, 64, 128, 256])
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": TEMPERATURE, "top_p": TOP_P, "seed": rid,
                "stream": True, "stream_options": {"include_usage": True}}
        if logprobs:
            body["logprobs"] = 0
        start, ttft, text, usage, done, chunks, lp, finish = time.perf_counter(), None, [], None, False, 0, None, None
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
                        chunks += ch.get("finish_reason") is None  # llama-cpp-python: one per token, then a last
                        if ch.get("text") and ttft is None:
                            ttft = time.perf_counter() - start
                        text.append(ch.get("text") or "")
                        if ch.get("logprobs"):
                            lp = ch["logprobs"]
                        finish = ch.get("finish_reason") or finish
        except (httpx.HTTPError, RuntimeError) as e:
            results.append({"id": rid, "error": repr(e)})
            continue
        results.append({"id": rid, "prompt": prompt, "max_tokens": max_tokens, "text": "".join(text), "ttft": ttft,
                        # without usage (llama-cpp-python streams one chunk per token), the chunks
                        "tokens": usage["completion_tokens"] if usage else chunks, "done": done,
                        "latency": time.perf_counter() - start, "logprobs": lp, "finish_reason": finish})


async def load(args, url: str, logprobs: bool):
    import httpx

    results: list = []
    ids = itertools.count()
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=900, limits=limits) as http:
        start = time.perf_counter()
        deadline = start + args.duration
        await asyncio.gather(*(client(http, url, ids, deadline, random.Random(i), results, logprobs)
                               for i in range(args.clients)))
        wall = time.perf_counter() - start
    return results, wall


def run_load(name: str, proc: subprocess.Popen, args, port: int, logprobs: bool):
    try:
        results, wall = asyncio.run(load(args, f"http://127.0.0.1:{port}/v1/completions", logprobs))
    finally:
        proc.terminate()
        proc.wait()
    ids = [r["id"] for r in results]
    assert len(ids) == len(set(ids)), "a request id was answered twice"
    ok = [r for r in results if "error" not in r]
    errors = [r for r in results if "error" in r]
    unfinished = [r["id"] for r in ok if not r["done"]]
    cut_short = [r["id"] for r in ok if r["done"] and r["finish_reason"] is None]  # [DONE] without a finish
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    tokens = sum(r["tokens"] for r in ok)

    def pct(q):
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")

    fig = {"name": name, "requests": len(results), "ok": len(ok), "errors": len(errors), "unfinished": len(unfinished),
           "cut_short": len(cut_short), "wall_s": wall, "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99), "tokens": tokens,
           "tokens_per_s": tokens / wall, "mean_latency_s": statistics.mean(r["latency"] for r in ok) if ok else None}
    print(f"{name}: {args.clients} streaming clients for {args.duration:.0f} s (+ drain: {wall:.1f} s in all)")
    print(f"  requests: {len(results)} ({len(ok)} ok, {len(errors)} errors, {len(unfinished)} without [DONE], "
          f"{len(cut_short)} ended by [DONE] without a finish_reason)")
    print(f"  finish_reason: {dict(sorted(collections.Counter(str(r['finish_reason']) for r in ok).items()))}")
    print(f"  time to first token: p50 {pct(0.5) * 1e3:.0f} ms, p99 {pct(0.99) * 1e3:.0f} ms; mean latency "
          f"{fig['mean_latency_s'] or float('nan'):.2f} s")
    print(f"  generated tokens: {tokens} ({tokens / wall:.1f} tokens/s)", flush=True)
    for r in errors[:5]:
        print("  error:", r["error"])
    return ok, fig


# ------------------------------------------------------------------------------------------ the offline check
def near_tie(gen, r, offline_tokens, offline_lps, args) -> dict:
    """Where and why a streamed reply left its offline result: see the module docstring."""
    import torch

    from llama.core.frontend.inputs import expand_params
    from llama.sample.sampling import sample, seeded_uniform

    server_tokens, server_lps = r["logprobs"]["tokens"], r["logprobs"]["token_logprobs"]
    t = next((i for i, (a, b) in enumerate(zip(server_tokens, offline_tokens)) if a != b),
             min(len(server_tokens), len(offline_tokens)))
    out = {"id": r["id"], "prompt": r["prompt"], "max_tokens": r["max_tokens"], "seed": r["id"],
           "temperature": TEMPERATURE, "top_p": TOP_P, "first_differing_token": t,
           "server_tokens": server_tokens, "offline_tokens": offline_tokens, "server_text": r["text"], "near_tie": False}
    diffs = [abs(a - b) for a, b in zip(server_lps[:t], offline_lps[:t])]
    out["max_logprob_diff_before"] = max(diffs, default=0.0)
    out["logprob_diffs_nonzero_before"] = sum(d > 0 for d in diffs)
    if t >= min(len(server_tokens), len(offline_tokens)):
        out["verdict"] = "one is a prefix of the other (a stop/length or detokenization difference)"
        return out
    # The offline request alone gives the token ids; the logits at step t come from one prefill of its prefix.
    prompt = gen.inputs.encode_text(r["prompt"])
    params = expand_params(1, temperature=TEMPERATURE, top_p=TOP_P, max_gen_len=r["max_tokens"], seed=r["id"])
    (req,) = gen._complete(gen.inputs.requests([prompt], params), lambda q: q)
    with gen.cache.hold():
        logits = gen.runner.logits([prompt + req.generated[:t]])[0, -1].float()
    offline_id = req.generated[t]
    server_ids = [i for i in range(len(logits)) if gen.tokenizer.decode([i]) == server_tokens[t]]
    # Could rounding explain it? Draw again, with llama.sample.sampling.sample and the request's seeded number, from the
    # logits perturbed by at most --lp-tol each (K random perturbations): does the server's token come out?
    k = 256
    g = torch.Generator().manual_seed(0)
    rows = logits[None] + (torch.rand(k, len(logits), generator=g) * 2 - 1) * args.lp_tol
    u = seeded_uniform(torch.tensor([r["id"]]), torch.tensor([0]), torch.tensor([t])).expand(k)
    drawn = sample(rows, torch.full((k,), TEMPERATURE), torch.full((k,), TOP_P), torch.zeros(k, dtype=torch.long), u)
    hits = sum(int(d) in server_ids for d in drawn.tolist())
    out.update({"offline_id": offline_id, "server_ids": server_ids,
                "logits": {str(i): float(logits[i]) for i in [offline_id] + server_ids},
                "perturbed_draws_giving_server_token": f"{hits}/{k}",
                "server_logprob_at": server_lps[t], "offline_logprob_at": offline_lps[t]})
    out["near_tie"] = out["max_logprob_diff_before"] <= args.lp_tol and hits > 0
    out["verdict"] = ("near-tie: the server's token is a draw of the same seeded number from logits within rounding "
                      "(--lp-tol) of the offline ones" if out["near_tie"] else "NOT a near-tie")
    return out


def check_offline(args, ckpt, ok: list, logprobs: bool) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    from llama import Llama

    tok = Path(ckpt) / "tokenizer.model"
    gen = Llama.build(str(ckpt), str(tok) if tok.exists() else None, max_seq_len=args.max_seq_len,
                      max_batch_size=args.max_batch_size, compile=False)
    ref = gen.text_completion([r["prompt"] for r in ok], temperature=TEMPERATURE, top_p=TOP_P,
                              max_gen_len=[r["max_tokens"] for r in ok], seed=[r["id"] for r in ok],
                              logprobs=logprobs) if ok else []
    mismatched = [(r, e) for r, e in zip(ok, ref) if r["text"] != e["generation"]]
    report = []
    for r, e in mismatched:
        if logprobs and r["logprobs"]:
            d = near_tie(gen, r, list(e["tokens"]), list(e["logprobs"]), args)
        else:
            d = {"id": r["id"], "prompt": r["prompt"], "max_tokens": r["max_tokens"], "near_tie": False,
                 "verdict": "no log-probabilities to analyse", "server_text": r["text"]}
        d["offline_text"] = e["generation"]
        cut = next((i for i, (a, b) in enumerate(zip(r["text"], e["generation"])) if a != b), None)
        d["first_differing_char"] = cut
        report.append(d)
        print(f"  differs: request {r['id']} ({r['prompt']!r}, max_tokens {r['max_tokens']}) at character {cut}, "
              f"token {d.get('first_differing_token')}: {d['verdict']}")
        if "logits" in d:
            print(f"    before it: max |logprob server - offline| {d['max_logprob_diff_before']:.2e} "
                  f"({d['logprob_diffs_nonzero_before']} of {d['first_differing_token']} tokens differ at all); "
                  f"at it: logits {d['logits']} (offline's token first), server logprob {d['server_logprob_at']:.6f}"
                  f", offline {d['offline_logprob_at']:.6f}; draws from logits perturbed by <= {args.lp_tol:g} "
                  f"giving the server's token: {d['perturbed_draws_giving_server_token']}")
        print("    server: ", repr(r["text"][max(0, (cut or 0) - 40):(cut or 0) + 40]))
        print("    offline:", repr(e["generation"][max(0, (cut or 0) - 40):(cut or 0) + 40]))
    ties = sum(bool(d.get("near_tie")) for d in report)
    print(f"  replies equal to their offline result: {len(ok) - len(mismatched)}/{len(ok)}; differing at a proven "
          f"near-tie: {ties}; differing otherwise: {len(mismatched) - ties}", flush=True)
    if args.dump:
        Path(args.dump).write_text(json.dumps(report, indent=1))
    return {"equal": len(ok) - len(mismatched), "near_ties": ties, "bad": len(mismatched) - ties}


def summary(figs: list, check: dict = None) -> None:
    """The runs above as one results table (harness.print_results): a row per server run."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import print_results

    rows = [{"server": f["name"], "requests": f["requests"], "ok": f["ok"], "errors": f["errors"],
             "without [DONE]": f["unfinished"], "[DONE] without finish_reason": f["cut_short"],
             "TTFT p50 ms": f"{f['ttft_p50_s'] * 1e3:.0f}", "TTFT p99 ms": f"{f['ttft_p99_s'] * 1e3:.0f}",
             "mean latency s": f"{f['mean_latency_s'] or float('nan'):.2f}", "tokens": f["tokens"],
             "tokens/s": f"{f['tokens_per_s']:.1f}", "wall s": f"{f['wall_s']:.1f}"} for f in figs]
    if check is not None:  # our server's replies against the offline results (the first run)
        rows[0]["offline check"] = (f"{check['equal']}/{figs[0]['ok']} equal, {check['near_ties']} near-ties, "
                                    f"{check['bad']} otherwise")
    print_results("serve-load", rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt_dir", default=str(STORIES))
    p.add_argument("--compare", choices=["llamacpp"], default=None)
    p.add_argument("--gguf", default=str(SMOLLM2), help="the GGUF both servers load under --compare llamacpp")
    p.add_argument("--llamacpp-interrupt", choices=["both", "true", "false"], default="both",
                   help="llama_cpp.server's --interrupt_requests: true (its default: a new request ends the stream "
                        "in progress with [DONE]), false (requests wait their turn), or a run with each")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max_batch_size", type=int, default=16)
    p.add_argument("--max_seq_len", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-logprobs", dest="logprobs", action="store_false")
    p.add_argument("--lp-tol", type=float, default=1e-4)
    p.add_argument("--dump", default=None)
    p.add_argument("--compile", default=None, help="our server's --compile (default: its own, auto: models of 50M+ "
                   "parameters compile their decode step once eager decoding has cost what compiling would, which "
                   "on 2 busy cores stalls a 60 s run for minutes; false keeps it eager)")
    p.add_argument("--skip-offline", action="store_true", help="no offline check (timing only)")
    args = p.parse_args()
    ckpt = args.gguf if args.compare else args.ckpt_dir

    port = free_port()
    ok, fig = run_load(f"llama.serve ({Path(ckpt).name})", start_ours(args, ckpt, port), args, port, args.logprobs)
    failed, figs, check = fig["errors"] + fig["unfinished"], [fig], None
    if not args.skip_offline:
        check = check_offline(args, ckpt, ok, args.logprobs)
        failed += check["bad"]
    if args.compare == "llamacpp":
        for interrupt in {"both": (True, False), "true": (True,), "false": (False,)}[args.llamacpp_interrupt]:
            port = free_port()
            figs.append(run_load(f"llama_cpp.server ({Path(args.gguf).name}, interrupt_requests={interrupt})",
                                 start_llamacpp(args, port, interrupt), args, port, False)[1])
    failed += fig["cut_short"]
    summary(figs, check)
    if failed:
        sys.exit(f"FAILED: {failed} errors, unfinished or differing replies that are not near-ties")


if __name__ == "__main__":
    main()
