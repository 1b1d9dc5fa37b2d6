"""Grammar libraries side by side: llguidance (what llama/sample/grammar.py uses), xgrammar and outlines-core, on the
same JSON schema, over each vocabulary, every library's vocabulary built from OUR tokenizer objects (no network,
no Hugging Face hub).

    python benchmarks/bench_grammar.py [--libs llguidance,xgrammar,outlines-core] [--walks 3] [TOKENIZER ...]

TOKENIZER: a tokenizer.model (sentencepiece or tiktoken ranks), a tokenizer.json or a .gguf (its embedded
tokenizer). Default: stories260K (512, sentencepiece), Llama 2 (32000, sentencepiece), Llama 3 (128256, tiktoken)
and SmolLM2-135M's GGUF (49152, byte-level BPE), all from ../shared.

xgrammar and outlines-core are benchmark-only dependencies (not in any extra; a library that is missing is shown
as "not installed" and the rest still runs):

    pip install --no-deps xgrammar apache-tvm-ffi outlines-core   # --no-deps: xgrammar's wheel asks for triton
                                                                 # (GPU kernels only) and must not touch torch

For each library and vocabulary it measures
- setup: the library's tokenizer info from our token bytes (the bytes themselves, shared by all, are timed
  separately), then compiling the schema (llguidance: parsing it and making the matcher; it computes masks lazily,
  so compiling is nearly free; xgrammar: GrammarCompiler.compile_json_schema; outlines-core: the schema's regex
  and its Index, the token-level automaton over the whole vocabulary);
- per token: computing the next-token mask into a 32-bit bitmask (the library call alone), and that plus applying
  it to a float32 logits row (xgrammar: its own CPU kernel; llguidance and outlines-core: the same eager torch
  bit-unpack + masked_fill, since their shipped torch kernels are torch.compile'd). A last row per vocabulary,
  "llguidance via llama.sample.grammar", is the path the engine ships (Matcher.mask: a byte per token, then torch).

Random logits (the same seed for every library) drive the walk, `--walks` times per library, until the grammar is
complete (or 3000 tokens); a walk counts as complete JSON when its decoded text parses. JSON is compact (no
whitespace between tokens) for every library. Torch runs on one thread (LLAMA_BENCH_THREADS to change); xgrammar's
compiler gets as many threads as torch.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from harness import print_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama.sample.grammar import Grammar, token_bytes, vocabulary  # noqa: E402
from llama.tokenizers.sentencepiece import load_tokenizer  # noqa: E402

SHARED = Path(os.environ.get("LLAMA_SHARED") or Path(__file__).resolve().parents[2] / "shared")
DEFAULT = [SHARED / "models/stories260K/tokenizer.model", SHARED / "tokenizers/llama2/tokenizer.model",
           SHARED / "tokenizers/llama3/tokenizer.model",
           SHARED / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}
LIBS = ["llguidance", "xgrammar", "outlines-core"]
MAX_STEPS = 3000
BITS = torch.arange(32, dtype=torch.int32)


def load(path: Path):
    if path.suffix == ".gguf":
        from llama.formats import gguf_file
        from llama.tokenizers import huggingface
        return huggingface.from_gguf(gguf_file.open_reader(path), path)
    return load_tokenizer(str(path))


def our_bytes(tok):
    """(bytes of every token id, set of special ids) from our tokenizer object."""
    if hasattr(tok, "special_tokens") and hasattr(tok, "model"):  # tiktoken (Llama 3)
        special = set(tok.special_tokens.values())
        return [b"" if i in special else tok.model.decode_single_token_bytes(i) for i in range(tok.n_words)], special
    tokens, special = token_bytes(tok)
    return tokens, set(special)


def apply_bitmask(row: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Eager torch: every token whose bit is 0 gets -inf."""
    bits = ((bitmask.unsqueeze(-1) >> BITS) & 1).view(-1)[: row.shape[-1]]
    row.masked_fill_(bits == 0, float("-inf"))


# Each library: setup(tok, tokens, special, stops) -> (info, seconds); compile(info) -> (factory, seconds), where
# factory() makes a fresh walker with .fill(bitmask), .apply(row, bitmask), .consume(token) -> complete.
class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, tokens, special, stops):
        import llguidance

        newline = tok.encode("\n", bos=False, eos=False)

        class Wrapped:  # llguidance's TokenizerWrapper protocol, over the shared bytes
            eos_token_id, bos_token_id = tok.eos_id, tok.bos_id
            special_token_ids = sorted(special)

            def __call__(self, s):  # as llama/sample/grammar.py: no sentencepiece dummy-prefix space mid-text
                if isinstance(s, bytes):
                    s = s.decode("utf-8", errors="replace")
                ids = tok.encode("\n" + s, bos=False, eos=False)
                return ids[len(newline):] if ids[: len(newline)] == newline else tok.encode(s, bos=False, eos=False)

        w = Wrapped()
        w.tokens = [b if i not in special else (tok.piece(i) or "").encode() for i, b in enumerate(tokens)]
        self.lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(w), n_vocab=tok.n_words,
                                            eos_token=sorted(stops))

    def compile(self):
        from llguidance import LLMatcher

        source = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
        LLMatcher(self.lltok, source, log_level=0)  # parses and checks the grammar (what compiling is here)
        lltok = self.lltok

        class Walker:
            def __init__(self):
                self.m = LLMatcher(lltok, source, log_level=0)

            def fill(self, bitmask):
                self.m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

            def apply(self, row, bitmask):
                apply_bitmask(row, bitmask)

            def consume(self, t):
                assert self.m.consume_token(t), self.m.get_error()
                return self.m.is_stopped()

        return Walker


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, tokens, special, stops):
        import xgrammar as xgr

        self.xgr = xgr
        # special tokens as empty strings: xgrammar never allows those inside the grammar
        self.info = xgr.TokenizerInfo([b"" if i in special else b for i, b in enumerate(tokens)], xgr.VocabType.RAW,
                                      vocab_size=tok.n_words, stop_token_ids=sorted(stops))

    def compile(self):
        xgr = self.xgr
        compiler = xgr.GrammarCompiler(self.info, max_threads=torch.get_num_threads(), cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                separators=(",", ":"))

        class Walker:
            def __init__(self):
                self.m = xgr.GrammarMatcher(compiled)

            def fill(self, bitmask):
                self.m.fill_next_token_bitmask(bitmask.view(1, -1))

            def apply(self, row, bitmask):
                xgr.apply_token_bitmask_inplace(row.view(1, -1), bitmask.view(1, -1), backend="cpu")

            def consume(self, t):
                assert self.m.accept_token(t)
                return self.m.is_completed()

        return Walker


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, tokens, special, stops):
        from outlines_core import Vocabulary

        eos = tok.eos_id
        by_bytes: dict = {}
        for i, b in enumerate(tokens):
            if i not in special and i not in stops and b:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = Vocabulary(eos, by_bytes)

    def compile(self):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        index = Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), self.vocab)

        class Walker:
            def __init__(self):
                self.g = Guide(index)

            def fill(self, bitmask):
                self.g.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

            def apply(self, row, bitmask):
                apply_bitmask(row, bitmask)

            def consume(self, t):
                self.g.advance(t, return_tokens=False)
                return self.g.is_finished()

        return Walker


CLASSES = {c.name: c for c in (LLGuidance, XGrammar, OutlinesCore)}
IMPORTS = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}


def pct(times, q):
    times = sorted(times)
    return times[min(len(times) - 1, int(q * len(times)))] * 1e3 if times else float("nan")


def walk(tok, stops, make, walks: int, fill_apply=True):
    """(fill times, fill+apply times, complete JSON count). make() -> walker."""
    gen = torch.Generator().manual_seed(0)
    fills, totals, parsed = [], [], {True: 0, False: 0}
    bitmask = torch.zeros((tok.n_words + 31) // 32, dtype=torch.int32)
    for _ in range(walks):
        w, ids = make(), []
        for _ in range(MAX_STEPS):
            row = torch.randn(tok.n_words, generator=gen)
            t0 = time.perf_counter()
            if fill_apply:
                w.fill(bitmask)
                t1 = time.perf_counter()
                w.apply(row, bitmask)
            else:  # the shipped llama.sample.grammar.Matcher: one call
                w.mask(row)
                t1 = time.perf_counter()
            t2 = time.perf_counter()
            fills.append(t1 - t0)
            totals.append(t2 - t0)
            i = int(torch.multinomial(torch.softmax(row, -1), 1, generator=gen))
            if i in stops:
                break
            ids.append(i)
            if w.consume(i):
                break
        for strict in (True, False):  # strict: RFC 8259, no raw control characters inside strings
            try:
                json.loads(tok.decode(ids), strict=strict)
                parsed[strict] += 1
                break
            except ValueError:
                pass
    return fills, totals, (f"{parsed[True]}/{walks}" if parsed[True] == sum(parsed.values()) else
                           f"{parsed[True]}/{walks} ({sum(parsed.values())} with raw control characters allowed)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tokenizers", nargs="*", type=Path, default=DEFAULT)
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--walks", type=int, default=3)
    args = p.parse_args()
    sys.set_int_max_str_digits(0)
    torch.set_num_threads(int(os.environ.get("LLAMA_BENCH_THREADS", "1")))
    rows = []
    for path in args.tokenizers:
        tok = load(path)
        label = f"{path.parent.name if path.name == 'tokenizer.model' else path.stem} ({tok.n_words})"
        stops = set(tok.stop_tokens) | {tok.eos_id}
        t = time.perf_counter()
        tokens, special = our_bytes(tok)
        shared = time.perf_counter() - t
        print(f"{label}: token bytes from our tokenizer in {shared:.2f} s", flush=True)
        for lib in args.libs.split(","):
            try:
                __import__(IMPORTS[lib])
            except ImportError:
                rows.append((label, lib, "not installed"))
                print(f"  {lib}: not installed", flush=True)
                continue
            try:
                t0 = time.perf_counter()
                obj = CLASSES[lib](tok, tokens, special, stops)
                t1 = time.perf_counter()
                make = obj.compile()
                t2 = time.perf_counter()
                fills, totals, parsed = walk(tok, stops, make, args.walks)
            except Exception as e:  # a library failing on one vocabulary must not stop the others
                rows.append((label, lib, f"error: {type(e).__name__}: {str(e)[:120]}"))
                print(f"  {lib}: error {e!r}", flush=True)
                continue
            rows.append((label, lib, t1 - t0, t2 - t1, pct(fills, .5), pct(fills, .9), pct(totals, .5),
                         pct(totals, .9), len(totals), parsed))
            print(f"  {lib}: {rows[-1][2:]}", flush=True)
        if "llguidance" in args.libs.split(","):
            t0 = time.perf_counter()
            vocabulary(tok)  # the engine's vocabulary (its own token bytes included)
            t1 = time.perf_counter()
            g = Grammar.json_schema(SCHEMA)
            g.matcher(tok, tok.stop_tokens)
            t2 = time.perf_counter()
            fills, totals, parsed = walk(tok, stops, lambda: g.matcher(tok, tok.stop_tokens), args.walks,
                                         fill_apply=False)
            rows.append((label, "llguidance via llama.sample.grammar", t1 - t0, t2 - t1, float("nan"), float("nan"),
                         pct(totals, .5), pct(totals, .9), len(totals), parsed))
            print(f"  llguidance via llama.sample.grammar: {rows[-1][2:]}", flush=True)

    print(f"\ntorch threads {torch.get_num_threads()}; token bytes from our tokenizers timed separately above\n")
    head = ["vocabulary", "library", "tokenizer info", "compile", "mask computed, median / p90",
            "computed + applied, median / p90", "tokens", "complete JSON"]
    table = []
    for r in rows:
        if len(r) == 3:
            table.append({**dict.fromkeys(head, ""), **dict(zip(head, r))})
            continue
        label, lib, info, comp, f50, f90, t50, t90, n, parsed = r
        fill = "—" if f50 != f50 else f"{f50:.3f} / {f90:.3f} ms"
        table.append(dict(zip(head, [label, lib, f"{info:.3f} s", f"{comp:.3f} s", fill,
                                     f"{t50:.3f} / {t90:.3f} ms", n, parsed])))
    print_results("grammar-libraries", table)


if __name__ == "__main__":
    main()
