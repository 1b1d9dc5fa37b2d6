"""Serving benchmarks for issue 4: what reusing a KV cache saves.

    python benchmarks/bench_serving.py [--dim 768 --n_layers 8 --threads 2 --repeats 2]

1. n=8 samples of a ~200-token prompt in one call (one prefill, cache copied to 8 rows) vs 8 separate calls.
2. 16 tasks sharing a ~400-token prefix: prefill() once and continue every task from it vs recomputing
   prefix + task for every task (generate() on the same token lists, so the outputs must be identical).
3. A 10-turn chat: per-turn latency with chat_session() (only the new tokens are prefilled) vs
   chat_completion() on the whole dialog every turn (its prefill grows with the conversation).

The model has random weights (generated in a temporary directory, never saved in the repository) and the
stories260K tokenizer, so the small vocabulary leaves the transformer layers to dominate the compute. EOS is
banned with a logits processor so every call generates exactly max_gen_len tokens. Each figure is the best of
--repeats runs (the machine is shared). Outputs of the two sides of each comparison are checked equal.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama import Llama  # noqa: E402
from llama.checkpoint import expected_shapes  # noqa: E402
from llama.model import ModelArgs  # noqa: E402

DEFAULT_TOKENIZER = ROOT.parent / "shared" / "models" / "stories260K" / "tokenizer.model"
WORDS = ("the cat dog girl boy park ball tree sun happy little big red blue went saw played ran jumped found "
         "a an and with to in on she he they was were very one day friend mom dad home garden bird flower").split()


def make_model(dirpath: Path, tokenizer: Path, dim: int, n_layers: int, n_heads: int) -> None:
    """A Meta-layout checkpoint with random weights (scaled so activations stay sane)."""
    params = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "multiple_of": 256, "norm_eps": 1e-5,
              "vocab_size": 512}
    from llama.tokenizer import Tokenizer
    params["vocab_size"] = Tokenizer(str(tokenizer)).n_words
    (dirpath / "params.json").write_text(json.dumps(params))
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in expected_shapes(ModelArgs.from_params(params)).items():
        if len(shape) == 1:
            state[name] = torch.ones(shape)
        elif name == "tok_embeddings.weight":
            state[name] = torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) * shape[1] ** -0.5
    torch.save(state, dirpath / "consolidated.00.pth")
    os.symlink(tokenizer, dirpath / "tokenizer.model")


def text_of(tokenizer, n_tokens: int, seed: int) -> str:
    """Random English words, about n_tokens long."""
    rng = random.Random(seed)
    words = []
    while len(tokenizer.encode(" ".join(words), bos=True, eos=False)) < n_tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def best(fn, repeats: int):
    """(best wall time in seconds, last result)."""
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--n_layers", type=int, default=8)
    ap.add_argument("--n_heads", type=int, default=12)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max_gen_len", type=int, default=32, help="tokens generated per sample / task")
    ap.add_argument("--turn_gen_len", type=int, default=24, help="tokens per chat reply")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.tokenizer.is_file():
        sys.exit(f"tokenizer {args.tokenizer} not found: pass --tokenizer")

    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), args.tokenizer.resolve(), args.dim, args.n_layers, args.n_heads)
        gen = Llama.build(tmp, str(Path(tmp) / "tokenizer.model"), max_seq_len=1024, max_batch_size=8)
    tok = gen.tokenizer
    n_params = sum(p.numel() for p in gen.model.parameters())
    no_eos = lambda ids, logits: logits.index_fill_(0, torch.tensor([tok.eos_id]), float("-inf"))
    G = args.max_gen_len
    print(f"model: random weights, dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads, vocab {tok.n_words}, "
          f"{n_params / 1e6:.1f}M parameters, fp32, CPU, {torch.get_num_threads()} thread(s); best of {args.repeats}")
    gen.text_completion(["warm up"], temperature=0, max_gen_len=4)
    rows = []

    # 1. n samples
    prompt = text_of(tok, 200, seed=1)
    p_len = len(tok.encode(prompt, bos=True, eos=False))
    kw = dict(temperature=1.0, top_p=0.9, max_gen_len=G, logits_processors=[no_eos])
    t_n, res_n = best(lambda: gen.text_completion([prompt], n=8, seed=42, **kw), args.repeats)
    t_sep, res_sep = best(lambda: [gen.text_completion([prompt], seed=42, **kw)[0] for _ in range(8)], args.repeats)
    assert res_n[0] == res_sep[0], "sample 0 of n=8 must equal the single seeded call"
    assert len({r["generation"] for r in res_n}) == 8, "the 8 samples should differ"
    rows.append((f"8 samples of a {p_len}-token prompt, {G} new tokens each", "n=8 in one call", t_n,
                 "8 separate calls", t_sep))

    # 2. shared prefix
    prefix_text = text_of(tok, 400, seed=2)
    tasks = [text_of(tok, 12, seed=100 + i) for i in range(16)]
    task_toks = [tok.encode(t, bos=False, eos=False) for t in tasks]

    def with_prefix():
        prefix = gen.prefill(prefix_text)
        return prefix, gen.text_completion(tasks, prefix=prefix, temperature=0, max_gen_len=G,
                                           logits_processors=[no_eos])

    t_pre, (prefix, res_pre) = best(with_prefix, args.repeats)
    full = [prefix.tokens + t for t in task_toks]

    def recompute():
        out = []
        for i in range(0, len(full), gen.max_batch_size):
            # the same token lists as with the prefix (checked below), all computed from scratch
            out += gen.text_completion([tok.decode(f) for f in full[i : i + gen.max_batch_size]], temperature=0,
                                       max_gen_len=G, logits_processors=[no_eos])
        return out

    assert all(tok.encode(tok.decode(f), bos=True, eos=False) == f for f in full), "tasks must re-encode alike"
    t_re, res_re = best(recompute, args.repeats)
    assert [r["generation"] for r in res_pre] == [r["generation"] for r in res_re], "prefix outputs differ"
    rows.append((f"16 tasks sharing a {len(prefix)}-token prefix (+{min(map(len, task_toks))}-"
                 f"{max(map(len, task_toks))} own tokens), {G} new tokens each", "prefill() + prefix=", t_pre,
                 "recompute prefix+task", t_re))

    # 3. 10-turn chat
    msgs = [text_of(tok, 14, seed=200 + i) for i in range(10)]
    ckw = dict(temperature=0, max_gen_len=args.turn_gen_len, logits_processors=[no_eos])
    turns = []
    for rep in range(args.repeats):
        session = gen.chat_session(system="You are a helpful assistant.")
        for i, m in enumerate(msgs):
            dialog = session.dialog + [{"role": "user", "content": m}]
            t = time.perf_counter()
            reply = session.send(m, **ckw)
            t_sess = time.perf_counter() - t
            t = time.perf_counter()
            again = gen.chat_completion([dialog], **ckw)[0]["generation"]["content"]
            t_chat = time.perf_counter() - t
            assert reply == again, f"turn {i + 1}: session and chat_completion differ"
            n_prompt = len(gen.formatter.encode_dialog_prompt(dialog))
            cur = (i + 1, n_prompt, session.last_prefilled, t_sess, t_chat)
            if rep == 0:
                turns.append(cur)
            else:
                turns[i] = (cur[0], cur[1], cur[2], min(turns[i][3], t_sess), min(turns[i][4], t_chat))

    print()
    print("| workload | reuse | time | baseline | time | speed-up |")
    print("|---|---|---|---|---|---|")
    for what, a, ta, b, tb in rows:
        print(f"| {what} | {a} | {ta:.2f} s | {b} | {tb:.2f} s | {tb / ta:.1f}x |")
    print()
    print(f"10-turn chat, {args.turn_gen_len}-token replies, per-turn latency:")
    print()
    print("| turn | prompt tokens | session: prefilled tokens | session | chat_completion (whole dialog) |")
    print("|---|---|---|---|---|")
    for turn, n_prompt, prefilled, ts, tc in turns:
        print(f"| {turn} | {n_prompt} | {prefilled} | {ts * 1000:.0f} ms | {tc * 1000:.0f} ms |")
    ts = [t[3] for t in turns]
    tc = [t[4] for t in turns]
    print()
    print(f"session: turns 2-10 take {min(ts[1:]) * 1000:.0f}-{max(ts[1:]) * 1000:.0f} ms; recomputing grows from "
          f"{tc[0] * 1000:.0f} to {tc[-1] * 1000:.0f} ms; total {sum(ts):.2f} s vs {sum(tc):.2f} s")


if __name__ == "__main__":
    main()
