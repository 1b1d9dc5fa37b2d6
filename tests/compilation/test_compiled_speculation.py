"""Speculative decoding with a compiled decode step (llama/core/worker/runner.py Runner._verify): a Verify pass runs
through the compiled step with its rows given, a request's k+1 rows sharing its cache row at consecutive positions.
Where our kernels take every product and the graph's own arithmetic is fp32 (stories260K in fp32), each row is
bitwise the one-token graph's, so greedy and seeded text and logprobs with speculation are those of the compiled step
without it. In bf16 the graphs of 1 and 4 rows round apart (logprobs 1e-3 apart, greedy text the same here): that
divergence is measured (benchmarks/speculative_compiled.py divergence, docs/performance.md).

Compiling costs seconds to tens of seconds per graph: drafts are capped at 3 tokens (graphs of 1 row without rows
given, 2 and 4 rows with), one slot, and stories260K; Inductor's on-disk cache makes reruns faster. Skipped when
there is no C++ compiler for Inductor's CPU backend.
"""

import shutil

import pytest
from conftest import CPU_SPECULATION, STORIES, need
from helpers import draft_tally

from llama import Llama
from llama.compilation.compiled_decode import CompiledDecode
from llama.config import memory_config
from llama.core.speculation import speculative

pytestmark = [CPU_SPECULATION, pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="torch.compile's CPU backend needs a C++ compiler (g++/clang++) on PATH")]

PROMPT = ["Lily and Ben went to the park. Lily and Ben"]


@pytest.fixture
def tally(monkeypatch):
    monkeypatch.setattr(speculative, "MEASURE", False)  # drafts decided by the tokens, not the machine's load
    monkeypatch.setattr(speculative, "K_MAX", 3)  # verify graphs of 2 and 4 rows (3 padded to 4)
    return draft_tally(monkeypatch.setattr)


def build(dtype, spec):
    d = str(need(STORIES))
    return Llama.build(d, d + "/tokenizer.model", max_seq_len=192, max_batch_size=1, dtype=dtype, compile=True,
                       prefix_cache="off", speculative=spec)


def test_compiled_speculation_equals_the_compiled_step(tally):
    off, on = build("float32", None), build("float32", "ngram")
    assert on.runner.compiled.outside  # our kernels take every product: the bitwise case
    for opts in (dict(temperature=0, logprobs=True), dict(temperature=0.8, top_p=0.95, seed=3, logprobs=True)):
        assert on.text_completion(PROMPT, max_gen_len=100, **opts) == off.text_completion(
            PROMPT, max_gen_len=100, **opts), opts
    assert set(on.runner.compiled.seen) == {(1, False), (2, True), (4, True)}  # every verify ran compiled
    assert tally["accepted"] > 10, tally
    # A prediction (no speculative=) is verified through the compiled step too, and changes nothing.
    want = off.text_completion(PROMPT, temperature=0, max_gen_len=100, logprobs=True)
    tally.clear()
    got = off.text_completion(PROMPT, temperature=0, max_gen_len=100, logprobs=True,
                              prediction=[want[0]["generation"]])
    assert got == want and tally["accepted"] > 50, tally


def test_compile_auto_is_refused_with_drafts_and_means_eager_in_build():
    """compile="auto" switches from eager to compiled steps by time: drafts would move the switch. Llama.build takes
    it as compile=False under speculation; a configuration of a lazy compiled step refuses speculation."""
    d = str(need(STORIES))
    g = Llama.build(d, d + "/tokenizer.model", max_seq_len=64, max_batch_size=1, speculative="ngram",
                    prefix_cache="off")
    assert g.runner.compiled is None
    with pytest.raises(ValueError, match="compile='auto'.*compile=True or compile=False"):
        Llama(g.model, g.tokenizer, compiled=CompiledDecode(g.model, lazy=True),
              config=memory_config(g.model, 1, 64, compile="auto", prefix_cache="off", speculative="ngram"))


def test_predictions_are_verified_only_where_compiled_rows_are_bitwise():
    """A request's prediction is drafted from under a compiled step in fp32 (our kernels), not in bf16, where the
    graphs of 1 and 4 rows round apart (a prediction would change the output)."""
    assert build("float32", None).core.predictions and not build("bfloat16", None).core.predictions
