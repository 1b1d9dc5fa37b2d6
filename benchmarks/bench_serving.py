"""Serving benchmarks: what reusing a KV cache saves.

    python benchmarks/bench_serving.py [--dim 768 --n_layers 8 --threads 1 --repeats 3]

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
import random
import sys
import tempfile
from pathlib import Path

import torch
from harness import STORIES, best, print_results, random_checkpoint, timed

from llama import Llama

DEFAULT_TOKENIZER = STORIES / "tokenizer.model"
WORDS = ("the cat dog girl boy park ball tree sun happy little big red blue went saw played ran jumped found "
         "a an and with to in on she he they was were very one day friend mom dad home garden bird flower").split()


def make_model(dirpath: Path, tokenizer: Path, dim: int, n_layers: int, n_heads: int) -> None:
    """A Meta-layout checkpoint with random weights (scaled so activations stay sane)."""
    from llama.tokenizers.sentencepiece import Tokenizer

    params = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "multiple_of": 256,
              "vocab_size": Tokenizer(str(tokenizer)).n_words}
    random_checkpoint(dirpath, params, tokenizer=tokenizer)


def text_of(tokenizer, n_tokens: int, seed: int) -> str:
    """Random English words, about n_tokens long."""
    rng = random.Random(seed)
    words = []
    while len(tokenizer.encode(" ".join(words), bos=True, eos=False)) < n_tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def n_samples(gen, tok, G: int, no_eos, repeats: int) -> tuple:
    """n=8 samples of one prompt in one call (one prefill) against 8 separate seeded calls."""
    prompt = text_of(tok, 200, seed=1)
    p_len = len(tok.encode(prompt, bos=True, eos=False))
    kw = dict(temperature=1.0, top_p=0.9, max_gen_len=G, logits_processors=[no_eos])
    t_n, c_n, res_n = best(lambda: gen.text_completion([prompt], n=8, seed=42, **kw), repeats)
    t_sep, c_sep, res_sep = best(lambda: [gen.text_completion([prompt], seed=42, **kw)[0] for _ in range(8)], repeats)
    assert res_n[0] == res_sep[0], "sample 0 of n=8 must equal the single seeded call"
    assert len({r["generation"] for r in res_n}) == 8, "the 8 samples should differ"
    return (f"8 samples of a {p_len}-token prompt, {G} new tokens each", "n=8 in one call", (t_n, c_n),
            "8 separate calls", (t_sep, c_sep))


def shared_prefix(gen, tok, G: int, no_eos, repeats: int) -> tuple:
    """16 tasks continued from one prefilled prefix against recomputing prefix + task for each."""
    prefix_text = text_of(tok, 400, seed=2)
    tasks = [text_of(tok, 12, seed=100 + i) for i in range(16)]
    task_toks = [tok.encode(t, bos=False, eos=False) for t in tasks]

    def with_prefix():
        prefix = gen.prefill(prefix_text)
        return prefix, gen.text_completion(tasks, prefix=prefix, temperature=0, max_gen_len=G,
                                           logits_processors=[no_eos])

    t_pre, c_pre, (prefix, res_pre) = best(with_prefix, repeats)
    full = [prefix.tokens + t for t in task_toks]

    def recompute():
        out = []
        for i in range(0, len(full), gen.max_batch_size):
            # the same token lists as with the prefix (checked below), all computed from scratch
            out += gen.text_completion([tok.decode(f) for f in full[i : i + gen.max_batch_size]], temperature=0,
                                       max_gen_len=G, logits_processors=[no_eos])
        return out

    assert all(tok.encode(tok.decode(f), bos=True, eos=False) == f for f in full), "tasks must re-encode alike"
    t_re, c_re, res_re = best(recompute, repeats)
    assert [r["generation"] for r in res_pre] == [r["generation"] for r in res_re], "prefix outputs differ"
    return (f"16 tasks sharing a {len(prefix)}-token prefix (+{min(map(len, task_toks))}-"
            f"{max(map(len, task_toks))} own tokens), {G} new tokens each", "prefill() + prefix=",
            (t_pre, c_pre), "recompute prefix+task", (t_re, c_re))


def chat_turns(gen, tok, turn_gen_len: int, no_eos, repeats: int) -> list:
    """A 10-turn chat: per turn [turn, prompt tokens, prefilled, session wall, CPU, chat_completion wall, CPU]."""
    msgs = [text_of(tok, 14, seed=200 + i) for i in range(10)]
    ckw = dict(temperature=0, max_gen_len=turn_gen_len, logits_processors=[no_eos])
    turns = []
    for rep in range(repeats):
        session = gen.chat_session(system="You are a helpful assistant.")
        for i, m in enumerate(msgs):
            dialog = session.dialog + [{"role": "user", "content": m}]
            w_sess, c_sess, reply = timed(lambda: session.send(m, **ckw))
            w_chat, c_chat, again = timed(lambda: gen.chat_completion([dialog], **ckw)[0]["generation"]["content"])
            assert reply == again, f"turn {i + 1}: session and chat_completion differ"
            n_prompt = len(gen.formatter.encode_dialog_prompt(dialog))
            cur = [i + 1, n_prompt, session.last_prefilled, w_sess, c_sess, w_chat, c_chat]
            if rep == 0:
                turns.append(cur)
            else:
                turns[i][3:] = [min(a, b) for a, b in zip(turns[i][3:], cur[3:])]
    return turns


def report(rows: list, turns: list, turn_gen_len: int) -> None:
    print()
    print("Times are wall / CPU seconds, best of the repeats.")
    print()
    print_results("cache-reuse", [
        {"workload": what, "with reuse": a, "reuse time": f"{wa:.2f} / {ca:.2f} s", "baseline": b,
         "baseline time": f"{wb:.2f} / {cb:.2f} s", "speed-up (CPU)": f"{cb / ca:.1f}x"}
        for what, a, (wa, ca), b, (wb, cb) in rows])
    print()
    print(f"10-turn chat, {turn_gen_len}-token replies, per-turn latency (wall / CPU ms):")
    print()
    print_results("cache-reuse-chat", [
        {"turn": turn, "prompt tokens": n_prompt, "session prefilled": prefilled,
         "session": f"{ws * 1000:.0f} / {cs * 1000:.0f}",
         "chat_completion of the whole dialog": f"{wc * 1000:.0f} / {cc * 1000:.0f}"}
        for turn, n_prompt, prefilled, ws, cs, wc, cc in turns])
    cs, cc = [t[4] for t in turns], [t[6] for t in turns]
    print()
    print(f"CPU per turn: session {min(cs) * 1000:.0f}-{max(cs) * 1000:.0f} ms (turn 1 {cs[0] * 1000:.0f}, turn 10 "
          f"{cs[-1] * 1000:.0f}); recomputing {cc[0] * 1000:.0f} -> {cc[-1] * 1000:.0f} ms; "
          f"10 turns {sum(cs):.2f} s vs {sum(cc):.2f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--n_layers", type=int, default=8)
    ap.add_argument("--n_heads", type=int, default=12)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: stable figures on a shared machine; 0 = torch's choice)")
    ap.add_argument("--repeats", type=int, default=3)
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
    print(f"model: random weights, dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads, vocab {tok.n_words}, "
          f"{n_params / 1e6:.1f}M parameters, fp32, CPU, {torch.get_num_threads()} thread(s); best of {args.repeats}")
    gen.text_completion(["warm up"], temperature=0, max_gen_len=4)
    rows = [n_samples(gen, tok, args.max_gen_len, no_eos, args.repeats),
            shared_prefix(gen, tok, args.max_gen_len, no_eos, args.repeats)]
    turns = chat_turns(gen, tok, args.turn_gen_len, no_eos, args.repeats)
    report(rows, turns, args.turn_gen_len)

if __name__ == "__main__":
    main()
