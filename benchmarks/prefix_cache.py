"""The paged KV pool and automatic prefix caching (llama/core/worker/kv_cache.py, llama/core/scheduling/paging.py).

  memory      how many concurrent sequences fit in a KV budget at 7B shapes: the slots' reservation (max_batch_size x
              max_seq_len) against the pool, counted from the pool's own accounting by running the scheduler (no
              model) until the sequences reach their length
  divergence  greedy tokens that differ per 10,000 between prefix_cache="on" and "off" (or "exact") on a chat's
              second turn, whose prompt holds a reply that decode steps wrote (bf16 / quantized kernels)
  preemption  greedy tokens that differ per 10,000 between a pool too small for its requests (preempted and
              recomputed) and a roomy one, per mode
  shared      N users sharing one long system prompt through the engine, all at once, then a follow-up each:
              time to first token p50/p99 and tokens/s, caching on against off
  chat        a 10-turn chat on one GGUF, time to first token per turn: ours through the engine with the prefix
              cache on and off, and llama-cpp-python's Llama (which reuses its last prompt's common prefix) in-process
  chat-http   the same over HTTP, the issue's side by side: our server (cache on, off) and llama-cpp-python's server
              on one GGUF (a file, or --model 1b: the random 1.38B written as bf16 GGUF), benchmarks/chat_http.py
  exact-cost  what prefix_cache="exact"'s row-invariant arithmetic (llama/kernels/invariant.py) costs: prefill and
              decode time against "on", side by side in one process, cache cleared before every request
  int8-kv     kv_cache_dtype="int8" against the model's dtype: logit error and perplexity of real text
              (llama/data/demo_corpus.txt, windows of 256, stride 128, as benchmarks/quant_accuracy.py)
  int8-kv-paired  the same per token, paired: the perplexity difference with its standard error, KL divergence,
              and a noise floor (benchmarks/kv_accuracy.py)
"""

import argparse
import statistics
import time
from pathlib import Path

from benchmarks import chat_http, kv_accuracy
from benchmarks.harness import SHAPES as MODEL_SHAPES
from benchmarks.harness import LLAMA2_TOKENIZER, print_results, prompt_tokens, random_checkpoint
from llama.core.worker.kv_cache import BLOCK_SIZE
from llama.core.frontend.textstream import SilentStream
from llama.quantization import schemes
SHAPES = {  # (n_layers, n_kv_heads, head_dim)
    "Llama 2 7B (32 KV heads)": (32, 32, 128),
    "Llama 3 8B (GQA, 8 KV heads)": (32, 8, 128),
}



def pool_run(blocks: int, seq: int, max_seq_len: int, prompt: int = 16) -> dict:
    """The scheduler and a BlockPool of `blocks`, no model: more sequences than fit, each a `prompt`-token prompt
    generating up to `seq` positions, all arriving at once; every step 'samples' token 1. Counts, from the pool's
    own accounting: the most sequences holding `seq` positions at once, the most blocks a running sequence held
    beyond the positions it had written, and the preemptions."""
    from llama.core.scheduling.block_pool import BlockPool
    from llama.core.frontend.params import SamplingParams
    from llama.core.frontend.request import Request
    from llama.core.scheduling.scheduler import Scheduler

    pool = BlockPool(blocks, BLOCK_SIZE, mode="off")  # distinct prompts: nothing to share
    n = blocks // pool.blocks_for(seq) + 2
    sched = Scheduler(max_batch_size=n, max_seq_len=max_seq_len, prefill_chunk=n * prompt, pool=pool)
    sched.add([Request(prompt=[i + 2] * prompt, params=SamplingParams(), max_new=seq - prompt, stream=SilentStream(),
                       stop_tokens={}) for i in range(n)])
    full, slack = 0, 0
    while sched.has_work():
        plan = sched.plan()
        for r in [r for r, s, c in plan.prefill if s + c == len(r.prompt) and not r.generated] + plan.decoding:
            r.advance(1)
        running = sched.running()
        full = max(full, sum(len(r.prompt) + len(r.generated) == seq for r in running))
        slack = max([slack] + [len(r.blocks) - pool.blocks_for(len(r.cached)) for r in running])
        for r in running:
            if r.finished:
                sched.retire(r)
    return {"full": full, "slack": slack, "preemptions": sched.stats["preemptions"]}


def memory(args) -> None:
    budget = int(args.budget_gb * 2**30)
    rows = []
    for name, (layers, kv, hd) in SHAPES.items():
        for kv_dtype, per in (("bf16", 2 * hd), ("int8 q8_0 (fp16 scale per 32)", hd + hd // 16)):
            per_pos = 2 * layers * kv * per  # K and V over every layer
            blocks = budget // (BLOCK_SIZE * per_pos)
            run = pool_run(blocks, args.seq, args.max_seq_len)
            rows.append({"shape": name, "KV dtype": kv_dtype, "bytes / position": per_pos,
                         f"slots (max_seq_len={args.max_seq_len})": budget // (per_pos * args.max_seq_len),
                         "pool": run["full"], "most blocks / sequence beyond its written positions": run["slack"],
                         "preemptions": run["preemptions"]})
    print(f"Concurrent {args.seq}-token sequences in {args.budget_gb:g} GiB of KV cache:")
    print_results("kv-memory", rows)


def build(ckpt: Path, tok, mode: str, dtype: str, slots: int, seq: int, quantize=None, **kw):
    from llama import Llama

    return Llama.build(str(ckpt), tok, max_seq_len=seq, max_batch_size=slots, dtype=dtype, prefix_cache=mode,
                       quantize=quantize, compile=False, **kw)


def preemption(args) -> None:
    """Greedy tokens that differ between a pool of --blocks blocks (requests preempted and recomputed) and a roomy
    pool, per mode: what recomputing decode-written positions by prefill changes in this dtype."""
    ckpt = Path(args.model)
    tok = None if ckpt.suffix == ".gguf" else str(ckpt / "tokenizer.model")
    starts = ["Once upon a time", "Lily and Ben went to the park", "The little dog", "Tom had a red ball",
              "One day, a cat", "The sun was hot", "A bird sang", "Sue went to the shop", "The big tree",
              "Max and his mom", "It was raining", "The girl had a doll", "A frog sat", "The boat was old",
              "Mia found a box", "The king was sad"]
    opts = dict(temperature=0.0, max_gen_len=args.gen, logprobs=True)
    rows = []
    for mode in ("on", "exact"):
        roomy = build(ckpt, tok, mode, args.dtype, args.slots, args.seq, args.quantize)
        per = roomy.cache.bytes // roomy.cache.num_blocks
        tight = build(ckpt, tok, mode, args.dtype, args.slots, args.seq, args.quantize,
                      kv_cache_memory=args.blocks * per)
        want, got = roomy.text_completion(starts, **opts), tight.text_completion(starts, **opts)
        total = sum(len(w["tokens"]) for w in want)
        diff = sum(sum(a != b for a, b in zip(g["tokens"], w["tokens"])) + abs(len(g["tokens"]) - len(w["tokens"]))
                   for g, w in zip(got, want))
        rows.append({"mode": mode, "preemptions": tight.cache.pool.stats["preemptions"], "greedy tokens": total,
                     "differing": diff, "per 10,000": round(1e4 * diff / max(total, 1), 1),
                     "sequences differing": f"{sum(g['tokens'] != w['tokens'] for g, w in zip(got, want))} of "
                                            f"{len(starts)}",
                     "sequences whose logprobs differ (bitwise)": sum(g["logprobs"] != w["logprobs"]
                                                                      for g, w in zip(got, want))})
    print(f"Preempted against un-preempted greedy text, {args.model}, {args.dtype}, {args.blocks} blocks:")
    print_results("prefix-cache-preemption", rows)


def divergence(args) -> None:
    from tqdm import tqdm

    ckpt = Path(args.model)
    tok = None if ckpt.suffix == ".gguf" else str(ckpt / "tokenizer.model")
    gens = {m: build(ckpt, tok, m, args.dtype, 4, args.seq, args.quantize) for m in ("off", "on", "exact")}
    topics = ["a cat", "a dog", "the sea", "a robot", "a tree", "the moon", "a train", "a dragon", "rain", "a king",
              "bread", "a river", "music", "a clock", "snow", "a bird"]
    counts = {m: 0 for m in ("on", "exact")}
    cold = 0  # "exact" against itself on a cleared cache: its own reference (its arithmetic is not "off"'s)
    total = 0
    opts = dict(temperature=0.0, max_gen_len=args.gen)
    for i in tqdm(range(args.dialogs), desc="dialogs"):
        d = [{"role": "user", "content": f"Tell me a story about {topics[i % len(topics)]} ({i})."}]
        for g in gens.values():
            g.clear_prefix_cache()
        first = {m: g.chat_completion([d], **opts)[0]["generation"]["content"] for m, g in gens.items()}
        d2 = d + [{"role": "assistant", "content": first["off"]}, {"role": "user", "content": "And then?"}]
        want = gens["off"].tokenizer.encode(gens["off"].chat_completion([d2], **opts)[0]["generation"]["content"],
                                            bos=False, eos=False)
        total += len(want)
        for m in counts:
            got = gens[m].tokenizer.encode(gens[m].chat_completion([d2], **opts)[0]["generation"]["content"],
                                           bos=False, eos=False)
            counts[m] += sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
            if m == "exact":
                gens[m].clear_prefix_cache()
                ref = gens[m].tokenizer.encode(gens[m].chat_completion([d2], **opts)[0]["generation"]["content"],
                                               bos=False, eos=False)
                cold += sum(a != b for a, b in zip(got, ref)) + abs(len(got) - len(ref))
    rows = [{"mode": m, "greedy tokens": total, "differing": c, "per 10,000": round(1e4 * c / max(total, 1), 1)}
            for m, c in counts.items()]
    rows.append({"mode": "exact, against exact on a cleared cache", "greedy tokens": "", "differing": cold,
                 "per 10,000": ""})
    print(f"{args.model} {args.dtype} {args.quantize or ''}: turn-2 greedy tokens against prefix_cache='off'")
    print_results("prefix-cache-divergence", rows)


def shared(args) -> None:
    import threading

    work = Path(args.workdir)
    if args.shape:  # a named shape ("1b": the 1.38B), bf16 weights of std 0.02 as the other benchmarks' shapes
        import torch

        params, name = MODEL_SHAPES[args.shape], f"shared-{args.shape}"
        ckpt = work / name
        if not (ckpt / "params.json").is_file():
            random_checkpoint(ckpt, params, tokenizer=LLAMA2_TOKENIZER, dtype=torch.bfloat16, std=0.02)
    else:
        params = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_heads,
                  "multiple_of": 256, "norm_eps": 1e-5, "vocab_size": 32000}
        ckpt = random_checkpoint(work / f"shared-{args.dim}-{args.n_layers}", params, tokenizer=LLAMA2_TOKENIZER)
    system = prompt_tokens(32000, args.system, seed=1)
    rows = []
    for mode in ("off", "on"):
        gen = build(ckpt, str(LLAMA2_TOKENIZER), mode, args.dtype, args.users, args.system + 64 + 2 * args.gen + 32)
        engine = gen.engine()
        opts = dict(temperature=0.0, max_gen_len=args.gen, logits_processors=[])
        for phase in ("first", "follow-up"):
            ttft, start, tokens = [], time.perf_counter(), [0]
            lock = threading.Lock()

            def user(u):
                extra = prompt_tokens(32000, 16 if phase == "first" else 48, seed=100 + u)
                arrive = time.perf_counter()
                r = engine.submit(system + extra, **opts)
                first = True
                for _ in r:
                    if first:
                        with lock:
                            ttft.append(time.perf_counter() - arrive)
                        first = False
                r.result()
                with lock:
                    tokens[0] += len(r.generated)

            threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            ttft.sort()
            rows.append({"prefix cache": mode, "phase": phase, "users": args.users,
                         "TTFT p50 s": round(statistics.median(ttft), 2),
                         "TTFT p99 s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 2),
                         "tok/s": round(tokens[0] / wall, 1),
                         "cached prompt tokens": gen.cache.pool.stats["cached_tokens"]})
        engine.close()
    what = args.shape or f"{args.dim}x{args.n_layers}"
    print(f"{args.users} users sharing a {args.system}-token system prompt (random {what} "
          f"{args.dtype}, {args.gen} tokens each):")
    print_results("prefix-cache-shared-system", rows)


def int8_kv(args) -> None:
    import torch

    from llama.cli.perplexity import perplexity

    ckpt = Path(args.model)
    tok = None if ckpt.suffix == ".gguf" else str(ckpt / "tokenizer.model")
    text = (Path(__file__).resolve().parents[1] / "llama" / "data" / "demo_corpus.txt").read_text()
    rows, logits = [], {}
    for kv in (None, "int8"):
        from llama import Llama

        gen = Llama.build(str(ckpt), tok, max_seq_len=256, max_batch_size=4, dtype=args.dtype, kv_cache_dtype=kv,
                          compile=False, prefix_cache="off")
        ids = gen.tokenizer.encode(text, bos=True, eos=False)[:256]
        with gen.cache.hold():
            logits[kv] = gen.runner.logits([ids])[0].float()
        rows.append({"KV cache": kv or args.dtype, "bytes / block": gen.cache.bytes // gen.cache.num_blocks,
                     "perplexity": round(perplexity(gen, text, 256, 128)["perplexity"], 4)})
    d = (logits["int8"] - logits[None]).abs()
    std = float(logits[None].std())
    rows[1].update({"mean logit error (x std)": round(float(d.mean()) / std, 5),
                    "max logit error (x std)": round(float(d.max()) / std, 5),
                    "argmax agreement": float((logits["int8"].argmax(-1) == logits[None].argmax(-1)).float().mean())})
    rows[1]["perplexity delta"] = round(rows[1]["perplexity"] - rows[0]["perplexity"], 4)
    print(f"{args.model} ({args.dtype}): int8 keys/values against {args.dtype}")
    print_results("int8-kv-accuracy", rows)
    del torch


def chat(args) -> None:
    from llama import Llama

    lines = ["Tell me about the sea.", "What lives there?", "And deeper down?", "How do they see?",
             "What do they eat?", "Are they dangerous?", "Tell me about whales.", "How big are they?",
             "Do they sing?", "Summarize our chat."]
    results = {}
    for mode in ("off", "on"):
        gen = Llama.build(args.model, None, max_seq_len=args.seq, max_batch_size=1, prefix_cache=mode,
                          compile=False)
        engine, dialog, ttft = gen.engine(), [{"role": "system", "content": args.system}], []
        for line in lines:
            dialog.append({"role": "user", "content": line})
            start = time.perf_counter()
            r = engine.submit(dialog, temperature=0.0, max_gen_len=args.gen)
            first = None
            for _ in r:
                first = first or time.perf_counter()
            ttft.append((first or time.perf_counter()) - start)
            dialog.append({"role": "assistant", "content": r.stream.text})
        engine.close()
        results[mode] = (ttft, [len(gen.inputs.encode_dialog(dialog[: 2 * i + 2])[0]) for i in range(len(lines))])
    try:
        from llama_cpp import Llama as CppLlama

        cpp = CppLlama(model_path=args.model, n_ctx=args.seq, verbose=False)
        dialog, ttft = [{"role": "system", "content": args.system}], []
        for line in lines:
            dialog.append({"role": "user", "content": line})
            start = time.perf_counter()
            first, text = None, ""
            for piece in cpp.create_chat_completion(dialog, temperature=0.0, max_tokens=args.gen, stream=True):
                first = first or time.perf_counter()
                text += piece["choices"][0]["delta"].get("content", "") or ""
            ttft.append(first - start)
            dialog.append({"role": "assistant", "content": text})
        results["llama-cpp-python"] = (ttft, None)
    except ImportError:
        pass
    rows = []
    for i in range(len(lines)):
        row = {"turn": i + 1, "prompt tokens": results["on"][1][i]}
        row.update({f"{k} TTFT s": round(v[0][i], 3) for k, v in results.items()})
        rows.append(row)
    sums = {k: sum(v[0][1:]) for k, v in results.items()}
    rows.append({"turn": "2-10 sum", "prompt tokens": "", **{f"{k} TTFT s": round(v, 2) for k, v in sums.items()}})
    print(f"10-turn chat on {args.model}, {args.gen}-token replies (prefix_cache on/off, llama-cpp-python):")
    print_results("prefix-cache-chat", rows)


def exact_cost(args) -> None:
    """Prefill seconds (a 1-token request on a cleared cache, per prompt length) and decode tokens/s (a 16-token
    prompt: --gen tokens against 1), "on" against "exact", the two modes' runs interleaved so the machine's load
    falls on both alike."""
    import torch

    from llama.kernels import tiled

    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = Path(args.ckpt or Path(args.workdir) / f"shared-{args.shape}")  # the file `shared --shape` writes
    tok = ckpt / "tokenizer.model" if args.ckpt else LLAMA2_TOKENIZER
    if not (ckpt / "params.json").is_file():
        random_checkpoint(ckpt, MODEL_SHAPES[args.shape], tokenizer=LLAMA2_TOKENIZER, dtype=torch.bfloat16, std=0.02)
    modes = ("on", "exact", "exact, untiled") if args.untiled else ("on", "exact")
    gens = {m: build(ckpt, str(tok), m.split(",")[0], args.dtype, 1, max(args.prompts) + args.gen + 16)
            for m in modes}
    vocab = gens["on"].model.params.vocab_size
    runs = [(n, 1) for n in args.prompts] + [(16, args.gen)]
    times = {(m, run): [] for m in gens for run in runs}
    for rep in range(args.reps + 1):  # the first round warms up and is not counted
        for n, gen in runs:
            prompt = prompt_tokens(vocab, n, seed=rep)
            for m, g in gens.items():
                g.clear_prefix_cache()
                tiled.enabled = m != "exact, untiled"  # untiled: every product in our kernel (before tiles)
                start = time.perf_counter()
                g.generate([prompt], max_gen_len=gen, temperature=0.0)
                if rep:
                    times[(m, (n, gen))].append(time.perf_counter() - start)
    tiled.enabled = True
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [{"measure": f"prefill of {n} tokens, s", **{m: round(med[(m, (n, 1))], 3) for m in gens},
             **{f"{m} / on": round(med[(m, (n, 1))] / med[("on", (n, 1))], 2) for m in modes[1:]}}
            for n in args.prompts]
    short = (16, args.gen)
    prompts = [r for r in runs if r[0] == 16 and r[1] == 1]
    base = {m: med[(m, prompts[0])] if prompts else 0.0 for m in gens}
    tps = {m: (args.gen - 1) / max(med[(m, short)] - base[m], 1e-9) for m in gens}
    rows.append({"measure": f"decode tok/s ({args.gen - 1} tokens after a 16-token prompt)",
                 **{m: round(tps[m], 2) for m in gens}, **{f"{m} / on": round(tps[m] / tps["on"], 2) for m in modes[1:]}})
    print(f"prefix_cache exact against on, {args.ckpt or args.shape} {args.dtype}, median of {args.reps}:")
    print_results("prefix-cache-exact-cost", rows)


def add_model_args(p) -> None:
    p.add_argument("--model", required=True, help="a Meta checkpoint directory or a GGUF file")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--quantize", default=None, choices=schemes.choices())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--budget-gb", type=float, default=24.0)
    m.add_argument("--seq", type=int, default=4096)
    m.add_argument("--max-seq-len", type=int, default=8192, dest="max_seq_len")
    d = sub.add_parser("divergence")
    add_model_args(d)
    d.add_argument("--dialogs", type=int, default=40)
    d.add_argument("--gen", type=int, default=64)
    d.add_argument("--seq", type=int, default=512)
    p = sub.add_parser("preemption")
    add_model_args(p)
    p.add_argument("--blocks", type=int, default=9)
    p.add_argument("--slots", type=int, default=6)
    p.add_argument("--gen", type=int, default=100)
    p.add_argument("--seq", type=int, default=128)
    s = sub.add_parser("shared")
    s.add_argument("--workdir", default="/tmp/llama-bench")
    s.add_argument("--users", type=int, default=32)
    s.add_argument("--system", type=int, default=1000)
    s.add_argument("--gen", type=int, default=16)
    s.add_argument("--dim", type=int, default=768)
    s.add_argument("--n_layers", type=int, default=8)
    s.add_argument("--n_heads", type=int, default=12)
    s.add_argument("--shape", default=None, choices=sorted(MODEL_SHAPES),
                   help="a named shape instead of --dim/--n_layers/--n_heads (1b: the 1.38B)")
    s.add_argument("--dtype", default="bf16")
    e = sub.add_parser("exact-cost")
    e.add_argument("--workdir", default="/tmp/llama-bench")
    e.add_argument("--shape", default="110m", choices=sorted(MODEL_SHAPES))
    e.add_argument("--dtype", default="bf16")
    e.add_argument("--prompts", type=int, nargs="+", default=[16, 64, 512], help="include 16: decode's baseline")
    e.add_argument("--gen", type=int, default=33)
    e.add_argument("--reps", type=int, default=3)
    e.add_argument("--ckpt", default=None, help="a checkpoint directory with its tokenizer.model instead of --shape")
    e.add_argument("--untiled", action="store_true", help="also \"exact\" with every product in our kernel")
    e.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (1: steadier on a shared CPU)")
    q = sub.add_parser("int8-kv")
    q.add_argument("--model", required=True, help="a Meta checkpoint directory or a GGUF file")
    q.add_argument("--dtype", default="bf16")
    c = sub.add_parser("chat")
    c.add_argument("--model", required=True, help="a GGUF file (llama-cpp-python runs the same file)")
    c.add_argument("--gen", type=int, default=32)
    c.add_argument("--seq", type=int, default=2048)
    c.add_argument("--system", default="You are a helpful assistant who answers in a few sentences.")
    chat_http.add_parser(sub)
    kv_accuracy.add_parser(sub)
    args = ap.parse_args(argv)
    {"memory": memory, "divergence": divergence, "preemption": preemption, "shared": shared, "int8-kv": int8_kv,
     "chat": chat, "chat-http": chat_http.run, "int8-kv-paired": kv_accuracy.run,
     "exact-cost": exact_cost}[args.what](args)


if __name__ == "__main__":
    main()
