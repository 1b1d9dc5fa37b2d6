"""Resumable batch generation: a JSONL file of prompts in, a JSONL file of results out, through the engine.

    python -m llama.batch --ckpt_dir DIR --tokenizer_path TOK --input prompts.jsonl --output results.jsonl
    torchrun --nproc_per_node 2 -m llama.batch ...   # model parallel: rank 0 reads, schedules and writes

Input: one JSON object per line with `id` (string or integer, unique), `prompt` (string) or `dialog` (list of
messages), and optional per-row sampling parameters (temperature, top_p, top_k, max_gen_len, seed, stop, logprobs,
top_logprobs, presence_penalty, frequency_penalty, repetition_penalty: every registered one that is plain data,
llama/core/frontend/param_registry.py) that override the command-line defaults.

Output: one JSON object per finished request, appended and flushed the moment it finishes (so in completion
order): `id`, `line`, `generation`, `finish_reason`, `num_tokens` (plus `tokens`/`logprobs` with logprobs, and
`top_logprobs` with top_logprobs), or
`id`, `line`, `error` for a request that failed. A line that cannot be read (bad JSON, no usable id, a duplicate
id) is reported on stderr and written as {"id": null, "line": N, "error": ...}.

Restarting with the same arguments skips every id (and every unreadable line number) already in the output, and
drops a truncated last line left by a kill, so a kill at any moment loses nothing and duplicates nothing. Every
row is seeded (its own `seed`, else one derived from --seed and its id), so a resumed run writes exactly the text
an uninterrupted one would have.
"""

import argparse
import json
import os
import queue
import sys
import time
import zlib
from typing import Dict, List, Optional, Set, Tuple


def row_seed(base: int, rid) -> int:
    """A per-row seed from the run's seed and the row's id: independent of order, batching and restarts."""
    return (base * 1_000_003 + zlib.crc32(json.dumps(rid).encode())) % (1 << 62)


def read_done(path: str) -> Tuple[Set, Set[int]]:
    """Ids and unreadable-line numbers already in the output; cut off a truncated last line (from a kill)."""
    ids, lines = set(), set()
    if not os.path.exists(path):
        return ids, lines
    with open(path, "rb") as f:
        data = f.read()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    for n, raw in enumerate(data[:keep].splitlines(), 1):
        try:
            rec = json.loads(raw)
            if rec.get("id") is not None:
                ids.add(_key(rec["id"]))
            elif isinstance(rec.get("line"), int):
                lines.add(rec["line"])
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            print(f"warning: {path}:{n} is not a result row; ignored", file=sys.stderr)
    return ids, lines


def _key(rid):
    return json.dumps(rid)


def parse_line(raw: str, n: int, seen: Set) -> Tuple[Optional[Dict], Optional[str]]:
    """(record, None) for a usable line, (None, error) for one that has no usable id."""
    try:
        rec = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, f"line {n} is not valid JSON: {e}"
    if not isinstance(rec, dict):
        return None, f"line {n} must be a JSON object, got {type(rec).__name__}"
    rid = rec.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return None, f"line {n} needs an \"id\" that is a string or an integer, got {rid!r}"
    if _key(rid) in seen:
        return None, f"line {n} repeats id {rid!r} of an earlier line"
    seen.add(_key(rid))
    return rec, None


def request_of(rec: Dict, defaults: Dict, base_seed: int) -> Tuple[object, Dict]:
    """(prompt or dialog, sampling params) of a record; ValueError names what is wrong."""
    from llama.core.frontend.params import batch_names  # torch: not for --help

    row_params = batch_names()
    unknown = set(rec) - {"id", "prompt", "dialog", *row_params}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}; allowed: id, prompt, dialog, "
                         f"{', '.join(row_params)}")
    if ("prompt" in rec) == ("dialog" in rec):
        raise ValueError("each line needs exactly one of \"prompt\" (a string) or \"dialog\" (a list of messages)")
    prompt = rec.get("prompt", rec.get("dialog"))
    if "prompt" in rec and not isinstance(prompt, str):
        raise ValueError(f"\"prompt\" must be a string, got {type(prompt).__name__}")
    if "dialog" in rec and not isinstance(prompt, list):
        raise ValueError(f"\"dialog\" must be a list of messages, got {type(prompt).__name__}")
    params = {**defaults, **{k: rec[k] for k in row_params if k in rec}}
    if params.get("seed") is None:
        params["seed"] = row_seed(base_seed, rec["id"])
    return prompt, params


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m llama.batch", description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--tokenizer_path", required=True)
    ap.add_argument("--input", required=True, help="JSONL of requests")
    ap.add_argument("--output", required=True, help="JSONL of results (appended to; existing ids are skipped)")
    ap.add_argument("--max_seq_len", type=int, default=512)
    ap.add_argument("--max_batch_size", type=int, default=8, help="KV-cache slots: requests decoded at once")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top_p", type=float, default=0.9)
    ap.add_argument("--top_k", type=int, default=0)
    ap.add_argument("--max_gen_len", type=int, default=None, help="default: up to the end of the cache")
    ap.add_argument("--seed", type=int, default=0, help="base of the per-row seeds of rows without their own")
    ap.add_argument("--prefill_chunk", type=int, default=128, help="prompt tokens prefilled per engine step")
    ap.add_argument("--prefix_cache", choices=("on", "exact", "off"), default="on",
                    help="reuse the cached blocks of prompts' shared starts (llama/core/scheduling/paging.py)")
    ap.add_argument("--pipeline_parallel_size", type=int, default=1,
                    help="pipeline stages under torchrun (world size = stages x tensor-parallel ranks)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    return ap


class Results:
    """The output file and the progress bar: each row written and flushed as it finishes, errors counted and
    reported on stderr."""

    def __init__(self, out, bar, input_path: str):
        self.out, self.bar, self.input = out, bar, input_path
        self.skipped = self.errors = self.new_tokens = 0
        self.start = time.time()

    def write(self, rec: Dict) -> None:
        self.out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.out.flush()
        self.bar.update(1)

    def error(self, rid, n: int, err) -> None:
        self.bar.write(f"{self.input}:{n}: {err}" if rid is None else f"{self.input}:{n}: id {rid!r}: {err}",
                       file=sys.stderr)
        self.errors += 1
        self.write({"id": rid, "line": n, "error": str(err)})

    def finished(self, rid, n: int, h) -> None:
        self.new_tokens += h.tokens_generated
        self.write({"id": rid, "line": n, **h.result(), "finish_reason": h.finish_reason,
                    "num_tokens": h.tokens_generated})
        self.bar.set_postfix_str(f"{self.new_tokens / max(time.time() - self.start, 1e-9):.1f} tok/s", refresh=False)


def submit_rows(engine, raw_lines, args, results: Results, finished: "queue.Queue") -> int:
    """Submit every line not already in the output (the unreadable and refused ones are written as errors);
    each handle puts (id, line, handle) on `finished` when done. Returns how many were submitted."""
    done_ids, done_lines = read_done(args.output)
    defaults = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "max_gen_len": args.max_gen_len}
    seen: Set = set()
    pending = 0
    for n, raw in raw_lines:
        rec, err = parse_line(raw, n, seen)
        if err is not None:
            if n in done_lines:
                results.skipped += 1
            else:
                results.error(None, n, err)
            continue
        if _key(rec["id"]) in done_ids:
            results.skipped += 1
            continue
        try:
            prompt, params = request_of(rec, defaults, args.seed)
            handle = engine.submit(prompt, **params)
        except ValueError as e:
            results.error(rec["id"], n, e)
            continue
        pending += 1
        handle.add_done_callback(lambda h, rid=rec["id"], n=n: finished.put((rid, n, h)))
    return pending


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm

    from llama.distributed import parallel
    from llama.generation import Llama

    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.isfile(args.input):
        ap.error(f"--input {args.input!r} does not exist")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        ap.error(f"the directory of --output {args.output!r} does not exist")
    generator = Llama.build(args.ckpt_dir, args.tokenizer_path, max_seq_len=args.max_seq_len,
                            max_batch_size=args.max_batch_size, pipeline_parallel_size=args.pipeline_parallel_size,
                            prefix_cache=args.prefix_cache)
    if parallel.model_parallel_rank() != 0 or parallel.pipeline_parallel_rank() != 0:  # under torchrun: replay rank 0's steps; rank 0 does all the I/O
        generator.engine(prefill_chunk=args.prefill_chunk).serve_forever()
        return 0
    with open(args.input, encoding="utf-8") as f:
        raw_lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    finished: "queue.Queue" = queue.Queue()
    bar = tqdm(total=len(raw_lines), unit="req", disable=args.no_progress, dynamic_ncols=True)
    with open(args.output, "a", encoding="utf-8") as out, generator.engine(prefill_chunk=args.prefill_chunk) as engine:
        results = Results(out, bar, args.input)
        pending = submit_rows(engine, raw_lines, args, results, finished)
        bar.update(results.skipped)
        for _ in range(pending):
            rid, n, h = finished.get()
            if h.exception() is not None:
                results.error(rid, n, h.exception())
            else:
                results.finished(rid, n, h)
    bar.close()
    stats = generator.cache.pool.stats
    print(f"{len(raw_lines) - results.skipped} new result rows ({results.errors} errors, {results.skipped} already "
          f"done), {results.new_tokens} tokens in {time.time() - results.start:.1f} s -> {args.output}; prefix cache: "
          f"{stats['cached_tokens']} of {stats['prompt_tokens']} prompt tokens reused", file=sys.stderr)
    return 0
