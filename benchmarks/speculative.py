"""Speculative decoding (llama/core/speculative.py): what a verify pass costs, and what prompt lookup gains.

  python -m benchmarks.speculative cost [--dim 1024 --layers 8]   c(k) = t(k+1-row Verify) / t(1-row Decode),
                                [--gguf FILE] [--threads N]        k = 1..7, a random bf16 model (or FILE), eager
  python -m benchmarks.speculative smollm2 [GGUF] [--tasks echo,story]  greedy "repeat this paragraph" and a
                                                                   story, speculation on and off, interleaved:
                                                                   speedup (wall, CPU time), acceptance
  python -m benchmarks.speculative smollm2 --prediction            the paragraph as a prediction instead
  python -m benchmarks.speculative smollm2 --llama-cpp             llama-cpp-python's prompt lookup alongside, each
                                                                   engine's speedup over its own plain decoding

Timings alternate the variants rep by rep and report medians, so a busy machine slows both alike.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO.parent / "shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. Every night "
             "the keeper climbed the spiral stairs, trimmed the wick and wound the clockwork that turned the great "
             "lens, so that ships far out at sea could find their way past the rocks and into the harbour.")


def cost(args) -> None:
    from llama import Llama
    from llama.core.plan import Decode, Prefill, SetBlocks, Verify
    from llama.formats.demo import write_random_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = REPO.parent / "shared/tokenizers/llama2/tokenizer.model"
    params = {"dim": args.dim, "n_layers": args.layers, "n_heads": args.dim // 64, "n_kv_heads": args.dim // 128,
              "multiple_of": 256, "norm_eps": 1e-5, "vocab_size": 32000}
    if args.gguf:
        g = Llama.build(args.gguf, None, max_seq_len=256, max_batch_size=1, compile=False, prefix_cache="off")
        what = f"{Path(args.gguf).name}, {torch.get_num_threads()} threads"
    else:
        with tempfile.TemporaryDirectory() as d:
            write_random_checkpoint(d, params, tokenizer_path=tok, dtype=torch.bfloat16)
            g = Llama.build(d, str(Path(d) / "tokenizer.model"), max_seq_len=256, max_batch_size=1,
                            dtype="bfloat16", compile=False, prefix_cache="off")
        what = f"dim {args.dim}, {args.layers} layers, bf16, {torch.get_num_threads()} threads"
    start = 100
    with g.cache.hold():
        g.runner.execute([SetBlocks(rows=[0], blocks=[g.cache.pool.allocate(16)]),
                          Prefill(tokens=[list(range(3, 3 + start))], start=0, rows=[0], last=[start - 1],
                                  kv_len=start)])
        ops = {0: Decode(tokens=[5], pos=[start], active=[0])}
        ops.update({k: Verify(tokens=[5] * (k + 1), pos=list(range(start, start + k + 1)), rows=[0] * (k + 1))
                    for k in range(1, 8)})
        times = {k: [] for k in ops}
        for _ in tqdm(range(args.reps), desc="reps"):
            for k, op in ops.items():
                t = time.perf_counter()
                g.runner.execute([op])
                times[k].append(time.perf_counter() - t)
    base = statistics.median(times[0])
    print(f"{what}: 1-token step {base * 1e3:.2f} ms (median of {args.reps})")
    for k in range(1, 8):
        print(f"c({k}) = {statistics.median(times[k]) / base:.2f}")


ASKS = {"echo": "Repeat this paragraph exactly: " + PARAGRAPH,
        "story": "Write a short story about a dragon who learns to cook."}


def _ours(args, counts: dict, now: dict) -> dict:
    """Our variants: task -> (tokens, text, logprobs) callables, plain and speculative, one generator each."""
    from llama import Llama
    from llama.core import speculative

    orig = speculative.Speculator.accepted

    def accepted(self, r, draft, n):
        c = counts[now["task"]]
        c["drafted"] += len(draft)
        c["accepted"] += n
        c["passes"] += bool(draft)
        return orig(self, r, draft, n)
    speculative.Speculator.accepted = accepted
    # --prediction: the same generator with and without the paragraph as the request's prediction (no speculative=)
    names = ("off", "prediction") if args.prediction else ("off", "ngram")
    gens = {v: Llama.build(str(args.gguf), None, max_seq_len=512, max_batch_size=1, compile=False,
                           speculative="ngram" if v == "ngram" else None) for v in dict.fromkeys(names)}

    def run(v):
        def go(task):
            extra = {"prediction": PARAGRAPH} if v == "prediction" else {}
            out = gens[v].chat_completion([[{"role": "user", "content": ASKS[task]}]], temperature=0,
                                          max_gen_len=args.tokens, logprobs=True, **extra)[0]
            return len(out["logprobs"]), out["generation"]["content"], out["logprobs"]
        return go
    now["times"] = gens[names[1]].core.drafting.times  # the step times its speculation measured
    return {v: run(v) for v in names}


def _llama_cpp(args) -> dict:
    """llama-cpp-python on the same GGUF, plain and with its prompt-lookup decoding (LlamaPromptLookupDecoding,
    its defaults: 2-grams, 10 drafted tokens), greedy, as many threads as ours."""
    from llama_cpp import Llama as CppLlama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = torch.get_num_threads()
    models = {v: CppLlama(str(args.gguf), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False,
                          draft_model=LlamaPromptLookupDecoding() if v == "cpp-lookup" else None)
              for v in ("cpp-off", "cpp-lookup")}

    def run(v):
        def go(task):
            out = models[v].create_chat_completion([{"role": "user", "content": ASKS[task]}], temperature=0.0,
                                                   top_k=1, max_tokens=args.tokens)
            return out["usage"]["completion_tokens"], out["choices"][0]["message"]["content"], None
        return go
    return {v: run(v) for v in models}


def _report(task: str, a: str, b: str, times: dict, cpu: dict, tokens: dict, reps: int) -> None:
    """b's speedup over a in tokens per second (wall and this process's CPU time): medians and per rep."""
    for name, clock in (("wall", times), ("CPU time", cpu)):
        rates = {v: [tokens[task, v] / t for t in clock[task, v]] for v in (a, b)}
        per_rep = ", ".join(f"{y / x:.2f}" for x, y in zip(rates[a], rates[b]))
        print(f"  {b} / {a}, {name}: {statistics.median(rates[b]) / statistics.median(rates[a]):.2f}x (medians of "
              f"{reps}, prefill included; per rep {per_rep})")


def smollm2(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = ["story"] if args.open_ended else args.tasks.split(",")
    counts = {t: {"drafted": 0, "accepted": 0, "passes": 0} for t in tasks}
    now = {"task": tasks[0]}
    runs = _ours(args, counts, now)
    ours = list(runs)
    if args.llama_cpp:
        runs.update(_llama_cpp(args))
    times = {(t, v): [] for t in tasks for v in runs}
    cpu, outs = {k: [] for k in times}, {}
    for _ in tqdm(range(args.reps), desc="reps"):
        for task in tasks:  # tasks and variants alternate, so a busy spell slows them alike
            now["task"] = task
            for v, go in runs.items():
                t, c = time.perf_counter(), time.process_time()
                outs[task, v] = go(task)
                times[task, v].append(time.perf_counter() - t)
                cpu[task, v].append(time.process_time() - c)
    tokens = {k: out[0] for k, out in outs.items()}
    for task in tasks:
        if outs[task, ours[0]] != outs[task, ours[1]]:
            sys.exit(f"{task}: speculation changed the output")
        k = counts[task]
        print(f"{task}: {tokens[task, 'off']} tokens, identical with and without {ours[1]}: "
              f"{outs[task, 'off'][1][:60]!r}...; over all reps {k['accepted']} of {k['drafted']} drafted tokens "
              f"accepted in {k['passes']} verify steps")
        _report(task, *ours, times, cpu, tokens, args.reps)
        if args.llama_cpp:
            same = "identical" if outs[task, "cpp-off"][1] == outs[task, "cpp-lookup"][1] else "DIFFERENT"
            print(f"  llama-cpp-python: {tokens[task, 'cpp-off']} tokens, {same} with and without its prompt lookup"
                  f", {'identical to' if outs[task, 'cpp-off'][1] == outs[task, 'off'][1] else 'not'} ours")
            _report(task, "cpp-off", "cpp-lookup", times, cpu, tokens, args.reps)
            _report(task, "cpp-lookup", ours[1], times, cpu, tokens, args.reps)
    print(f"CPU time is this process's, {torch.get_num_threads()} threads: robust to other processes' load")
    table = now["times"].table()
    if table:
        print("step times the speculating generator measured, c = t(rows) / t(1 row): " + ", ".join(
            f"{m} rows {t * 1e3:.1f} ms (c {t / table[0][1]:.2f})" for m, t in table))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--dim", type=int, default=1024)
    c.add_argument("--layers", type=int, default=8)
    c.add_argument("--reps", type=int, default=30)
    c.add_argument("--gguf", default=None, help="a real model instead (e.g. the SmolLM2 Q4_1 file)")
    c.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    s = sub.add_parser("smollm2")
    s.add_argument("gguf", nargs="?", default=str(SMOLLM2))
    s.add_argument("--tokens", type=int, default=200)
    s.add_argument("--reps", type=int, default=5)
    s.add_argument("--tasks", default="echo,story",
                   help="comma-separated, from echo (repeat a paragraph) and story (open-ended: the adaptive floor)")
    s.add_argument("--open-ended", action="store_true", help="the story task alone (as --tasks story)")
    s.add_argument("--llama-cpp", action="store_true", dest="llama_cpp",
                   help="llama-cpp-python plain and with its prompt lookup (LlamaPromptLookupDecoding) alongside")
    s.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    s.add_argument("--prediction", action="store_true",
                   help="the paragraph as the request's prediction (OpenAI's Predicted Outputs) instead of ngram")
    args = p.parse_args(argv)
    (cost if args.what == "cost" else smollm2)(args)


if __name__ == "__main__":
    main()
