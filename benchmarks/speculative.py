"""Speculative decoding (llama/core/speculation/speculative.py): what a verify pass costs, and what prompt lookup gains.

  python -m benchmarks.speculative cost [--dim 1024 --layers 8]   c(k) = t(k+1-row Verify) / t(1-row Decode),
                                [--gguf FILE] [--threads N]        k = 1..7, a random bf16 model (or FILE), eager
  python -m benchmarks.speculative smollm2 [GGUF] [--tasks echo,story]  greedy "repeat this paragraph" and a
                                                                   story, speculation on and off, interleaved:
                                                                   speedup (wall, CPU time), acceptance
  python -m benchmarks.speculative smollm2 --prediction            the paragraph as a prediction instead
  python -m benchmarks.speculative smollm2 --decode-alone          also the ratios without the (shared) prefill
  python -m benchmarks.speculative smollm2 --llama-cpp             llama-cpp-python's prompt lookup alongside, each
                                                                   engine's speedup over its own plain decoding
  python -m benchmarks.speculative smollm2 --draft Q4_0|first8|keep0-9,20-29 [--llama-cpp] [--temperature 0.8]
                                                                   a draft model made from the GGUF itself
                                                                   (benchmarks/early_exit.py) instead of ngram; with
                                                                   --llama-cpp, the same draft file through
                                                                   llama-cpp-python's LlamaDraftModel interface

Timings alternate the variants rep by rep and report medians, so a busy machine slows both alike.
"""

import argparse
import collections
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


def random_llama(dim: int, layers: int, n_heads: int, n_kv_heads: int, threads: int = 0, **build):
    """A Llama of random bf16 weights of that shape (Llama 2's tokenizer, 256 positions, one row), built with
    build's options (compile, quantize, dtype), for timing steps; the checkpoint is written to a temporary dir."""
    from llama import Llama
    from llama.hub.demo import write_random_checkpoint

    if threads:
        torch.set_num_threads(threads)
    tok = REPO.parent / "shared/tokenizers/llama2/tokenizer.model"
    params = {"dim": dim, "n_layers": layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "multiple_of": 256,
              "norm_eps": 1e-5, "vocab_size": 32000}
    with tempfile.TemporaryDirectory() as d:
        write_random_checkpoint(d, params, tokenizer_path=tok, dtype=torch.bfloat16)
        return Llama.build(d, str(Path(d) / "tokenizer.model"), max_seq_len=256, max_batch_size=1,
                           prefix_cache="off", **{"dtype": "bfloat16", **build})


def verify_ops(g, ks, start: int = 100) -> dict:
    """Row 0 of g's cache prefilled to `start` positions (call inside g.cache.hold()), and the ops to time there:
    {0: a 1-token Decode, k: a Verify of k + 1 rows for each k in ks}."""
    from llama.core.scheduling.plan import Decode, Prefill, SetBlocks, Verify

    g.runner.execute([SetBlocks(rows=[0], blocks=[g.cache.pool.allocate(16)]),
                      Prefill(tokens=[list(range(3, 3 + start))], start=0, rows=[0], last=[start - 1], kv_len=start)])
    ops = {0: Decode(tokens=[5], pos=[start], active=[0])}
    ops.update({k: Verify(tokens=[5] * (k + 1), pos=list(range(start, start + k + 1)), rows=[0] * (k + 1))
                for k in ks})
    return ops


def cost(args) -> None:
    from llama import Llama

    if args.gguf:
        if args.threads:
            torch.set_num_threads(args.threads)
        g = Llama.build(args.gguf, None, max_seq_len=256, max_batch_size=1, compile=False, prefix_cache="off")
        what = f"{Path(args.gguf).name}, {torch.get_num_threads()} threads"
    else:
        g = random_llama(args.dim, args.layers, args.dim // 64, args.dim // 128, args.threads, compile=False)
        what = f"dim {args.dim}, {args.layers} layers, bf16, {torch.get_num_threads()} threads"
    with g.cache.hold():
        ops = verify_ops(g, range(1, 8))
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
    """Our variants: name -> go(task) -> (tokens, text, logprobs), "off" (plain decoding) first, one generator
    each: "ngram" (prompt lookup), "prediction" (the paragraph as the request's prediction, no speculative=),
    "draft" (args.draft_file as the draft model)."""
    from llama import Llama
    from llama.core.speculation import speculative

    orig = speculative.Speculator.accepted

    def accepted(self, r, draft, n):
        c = counts[now["task"], now["variant"]]
        c["drafted"] += len(draft)
        c["accepted"] += n
        c["passes"] += bool(draft)
        return orig(self, r, draft, n)
    speculative.Speculator.accepted = accepted
    names = ["off"] + (["prediction"] if args.prediction else ["draft"] if args.draft else ["ngram"])
    build = {"off": {}, "prediction": {}, "ngram": {"speculative": "ngram"},
             "draft": {"draft_model": str(args.draft_file) if args.draft else None}}
    gens = {v: Llama.build(str(args.gguf), None, max_seq_len=512, max_batch_size=1, compile=False, **build[v])
            for v in names}

    def run(v):
        def go(task, tokens=args.tokens):
            extra = {"prediction": PARAGRAPH} if v == "prediction" else {}
            out = gens[v].chat_completion([[{"role": "user", "content": ASKS[task]}]], max_gen_len=tokens,
                                          logprobs=True, **_sampling(args), **extra)[0]
            return len(out["logprobs"]), out["generation"]["content"], out["logprobs"]
        return go
    now["times"] = gens[names[1]].core.drafting.times  # the step times its speculation measured
    return {v: run(v) for v in names}


def _sampling(args) -> dict:
    """Greedy, or seeded sampling at --temperature (the same draws with and without speculation)."""
    return {"temperature": 0} if not args.temperature else {"temperature": args.temperature, "seed": args.seed}


def _cpp_draft(path: str, threads: int, k: int):
    """llama-cpp-python's draft-model interface (llama_speculative.LlamaDraftModel, of which it ships only prompt
    lookup) over a second llama.cpp model: k greedy tokens after the context, its KV cache reused by prefix."""
    import numpy as np
    from llama_cpp import Llama as CppLlama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class Draft(LlamaDraftModel):
        def __init__(self):
            self.model = CppLlama(path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)

        def __call__(self, input_ids, /, **kwargs):
            out = []
            for tok in self.model.generate(list(map(int, input_ids)), top_k=1, temp=0.0, reset=True):
                out.append(tok)
                if len(out) == k:
                    break
            return np.array(out, dtype=np.intc)
    return Draft()


def _llama_cpp(args) -> dict:
    """llama-cpp-python on the same GGUF, plain and with its prompt-lookup decoding (LlamaPromptLookupDecoding,
    its defaults: 2-grams, 10 drafted tokens) or, with --draft, the same draft file through its draft-model
    interface; as many threads as ours, greedy or at --temperature (its own sampler and seed)."""
    from llama_cpp import Llama as CppLlama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = torch.get_num_threads()
    spec = "cpp-draft" if args.draft else "cpp-lookup"
    drafts = {"cpp-off": None, "cpp-lookup": lambda: LlamaPromptLookupDecoding(),
              "cpp-draft": lambda: _cpp_draft(str(args.draft_file), threads, args.cpp_draft_tokens)}
    models = {v: CppLlama(str(args.gguf), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False,
                          draft_model=drafts[v]() if drafts[v] else None, seed=args.seed)
              for v in ("cpp-off", spec)}
    sampling = {"temperature": 0.0, "top_k": 1} if not args.temperature else {"temperature": args.temperature}

    def run(v):
        def go(task):
            models[v].set_seed(args.seed)
            out = models[v].create_chat_completion([{"role": "user", "content": ASKS[task]}], max_tokens=args.tokens,
                                                   **sampling)
            return out["usage"]["completion_tokens"], out["choices"][0]["message"]["content"], None
        return go
    return {v: run(v) for v in models}


def _report(task: str, a: str, b: str, times: dict, cpu: dict, tokens: dict, reps: int,
            prefill: "dict | None" = None) -> None:
    """b's speedup over a in tokens per second (wall and this process's CPU time): medians and per rep; with
    prefill (the same clocks of a 1-token run), also the decode alone: the tokens after the first over the time
    after the median prefill."""
    for name, clock in (("wall", times), ("CPU time", cpu)):
        rates = {v: [tokens[task, v] / t for t in clock[task, v]] for v in (a, b)}
        per_rep = ", ".join(f"{y / x:.2f}" for x, y in zip(rates[a], rates[b]))
        print(f"  {b} / {a}, {name}: {statistics.median(rates[b]) / statistics.median(rates[a]):.2f}x (medians of "
              f"{reps}, prefill included; per rep {per_rep})")
        if prefill is not None:
            p = statistics.median(clock[task, "prefill"])
            rates = {v: [(tokens[task, v] - 1) / (t - p) for t in clock[task, v]] for v in (a, b)}
            print(f"  {b} / {a}, {name}, decode alone: {statistics.median(rates[b]) / statistics.median(rates[a]):.2f}x"
                  f" (prefill {p * 1e3:.0f} ms; decode {(tokens[task, a] - 1) / statistics.median(rates[a]) * 1e3:.0f}"
                  f" ms off)")


def smollm2(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.draft:
        from benchmarks.early_exit import draft_file
        from llama.core.speculation import draft_model

        args.draft_file = draft_file(Path(args.gguf), args.draft)
        if args.force:  # every step drafts K_MAX tokens: acceptance, not speed
            from llama.core.speculation import speculative

            speculative.MEASURE = False
            speculative.Speculator.acceptance = lambda *a: 0.9
        if args.greedy_draft:
            draft_model.picker = lambda request, generated: lambda logits, drafted: int(logits.argmax())
    tasks = ["story"] if args.open_ended else args.tasks.split(",")
    now = {"task": tasks[0], "variant": "off"}
    counts = collections.defaultdict(lambda: {"drafted": 0, "accepted": 0, "passes": 0})  # (task, variant) ->
    runs = _ours(args, counts, now)
    ours = list(runs)
    if args.decode_alone:  # the plain generator's prefill and first token alone, to take out of the times
        first = runs["off"]
        runs["prefill"] = lambda task: first(task, 1)
    if args.llama_cpp:
        runs.update(_llama_cpp(args))
    times = {(t, v): [] for t in tasks for v in runs}
    cpu, outs = {k: [] for k in times}, {}
    for _ in tqdm(range(args.reps), desc="reps"):
        for task in tasks:  # tasks and variants alternate, so a busy spell slows them alike
            now["task"] = task
            for v, go in runs.items():
                now["variant"] = v
                t, c = time.perf_counter(), time.process_time()
                outs[task, v] = go(task)
                times[task, v].append(time.perf_counter() - t)
                cpu[task, v].append(time.process_time() - c)
    tokens = {k: out[0] for k, out in outs.items()}
    for task in tasks:
        if outs[task, ours[0]] != outs[task, ours[1]]:
            sys.exit(f"{task}: speculation changed the output")
        k = counts[task, ours[1]]
        print(f"{task}: {tokens[task, 'off']} tokens, identical with and without {ours[1]}: "
              f"{outs[task, 'off'][1][:60]!r}...; over all reps {k['accepted']} of {k['drafted']} drafted tokens "
              f"accepted in {k['passes']} verify steps")
        _report(task, *ours, times, cpu, tokens, args.reps, "prefill" if args.decode_alone else None)
        if args.llama_cpp:
            spec = [v for v in runs if v.startswith("cpp-") and v != "cpp-off"][0]
            same = "identical" if outs[task, "cpp-off"][1] == outs[task, spec][1] else "DIFFERENT"
            print(f"  llama-cpp-python: {tokens[task, 'cpp-off']} tokens, {same} with and without {spec}"
                  f", {'identical to' if outs[task, 'cpp-off'][1] == outs[task, 'off'][1] else 'not'} ours")
            _report(task, "cpp-off", spec, times, cpu, tokens, args.reps)
            _report(task, spec, ours[1], times, cpu, tokens, args.reps)
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
    s.add_argument("--draft", default=None, metavar="SPEC",
                   help="a draft model made from the GGUF (benchmarks/early_exit.py) instead of ngram: firstN (its "
                        "first N blocks), keepA-B,C-D (those blocks) or a llama.cpp type to requantize to (Q4_0)")
    s.add_argument("--cpp-draft-tokens", type=int, default=5, dest="cpp_draft_tokens",
                   help="tokens llama-cpp-python's draft model proposes per step (with --draft --llama-cpp)")
    s.add_argument("--force", action="store_true",
                   help="with --draft: draft on every step, whatever it costs (to measure acceptance, not speed)")
    s.add_argument("--greedy-draft", action="store_true", dest="greedy_draft",
                   help="the draft model drafts by argmax even for seeded requests (the old drafting), to compare")
    s.add_argument("--decode-alone", action="store_true", dest="decode_alone",
                   help="also time a 1-token run of each task and report our ratios without the prefill")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling (--seed)")
    s.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    (cost if args.what == "cost" else smollm2)(args)


if __name__ == "__main__":
    main()
