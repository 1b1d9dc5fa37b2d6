"""Per-token cost of structured outputs (llama/grammar.py, llguidance): building a tokenizer's vocabulary once,
then computing and applying the token mask at every step.

    python benchmarks/bench_grammar.py [TOKENIZER ...]   (default: stories260K, Llama 2 and Llama 3 from ../shared)

Torch runs on one thread (LLAMA_BENCH_THREADS to change): on a busy machine the mask's small tensor operations
cost far more spread over several threads than on one.

Random logits drive the walk (no model), over a schema with a bounded string, an integer and an enum array, so
the figure is the grammar's cost alone. Prints the median and p90 per token for each vocabulary.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama.grammar import Grammar, vocabulary  # noqa: E402
from llama.tokenizer import load_tokenizer  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
DEFAULT = [SHARED / "models/stories260K/tokenizer.model", SHARED / "tokenizers/llama2/tokenizer.model",
           SHARED / "tokenizers/llama3/tokenizer.model"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}


def main(paths) -> None:
    sys.set_int_max_str_digits(0)
    torch.set_num_threads(int(os.environ.get("LLAMA_BENCH_THREADS", "1")))
    torch.manual_seed(0)
    for path in paths:
        tok = load_tokenizer(str(path))
        start = time.perf_counter()
        vocabulary(tok)
        build = time.perf_counter() - start
        grammar, times, parsed = Grammar.json_schema(SCHEMA), [], 0
        for _ in range(3):
            m, ids = grammar.matcher(tok, tok.stop_tokens), []
            for _ in range(3000):
                row = torch.randn(tok.n_words)
                t = time.perf_counter()
                m.mask(row)
                times.append(time.perf_counter() - t)
                i = int(torch.distributions.Categorical(logits=row).sample())
                if i in tok.stop_tokens:
                    break
                ids.append(i)
                if m.consume(i):
                    break
            try:
                json.loads(tok.decode(ids))
                parsed += 1
            except ValueError:
                pass
        times.sort()
        print(f"{path}: {tok.n_words} tokens, vocabulary built in {build:.2f} s; mask per token median "
              f"{times[len(times) // 2] * 1e3:.3f} ms, p90 {times[int(len(times) * 0.9)] * 1e3:.3f} ms over "
              f"{len(times)} tokens; {parsed}/3 outputs complete JSON")


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
