"""The compiled decode step (torch.compile, max-autotune, frozen weights) gives the reference's greedy ids on
stories260K in fp32, and int8 compiled follows int8 eager.

Compiling costs tens of seconds per graph, so this module compiles only two graphs (fp32 batch 2, int8 batch 4);
Inductor's on-disk cache makes reruns faster. Skipped when there is no C++ compiler for Inductor's CPU backend.
"""

import shutil

import pytest
import torch

from llama import Llama
from llama.compile import bucket, compile_decode, own_storage

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="torch.compile's CPU backend needs a C++ compiler (g++/clang++) on PATH",
)


def build(stories_dir, **kw):
    return Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=160, max_batch_size=2,
                       **kw)


def test_compiled_greedy_matches_goldens(stories_dir, goldens):
    llama = build(stories_dir, compile=True)
    prompts = [g["prompt_tokens"] for g in goldens.values()]
    out, _ = llama.generate(prompts, max_gen_len=128, temperature=0)
    assert llama.model.compiled_step.seen.keys() == {(2, False)}  # every decode step went through the graph
    for got, g in zip(out, goldens.values()):
        assert got == g["generated_tokens"]


def test_compiled_int8_follows_eager_int8_with_a_padded_batch(stories_dir, goldens):
    """Batch 3 in a cache of 4 rows runs as the batch-4 graph (padded with a copy of the last row)."""
    llama = Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=160, max_batch_size=4,
                        quantize="int8")
    prompts = torch.tensor([g["prompt_tokens"][:5] for g in goldens.values()] + [[1, 300, 301, 302, 303]])
    model = llama.model
    model(prompts, 0)
    nxt = torch.tensor([[300], [301], [302]])
    pos = torch.tensor([5, 5, 4])
    eager = model(nxt, pos)
    compile_decode(model, True)
    model(prompts, 0)
    compiled = model(nxt, pos)
    assert compiled.shape == eager.shape
    assert model.compiled_step.seen.keys() == {(4, True)}
    # bf16 activations: Inductor keeps fused intermediates in fp32, so logits differ by bf16 rounding (max 0.11
    # measured, logit std ~7), not more; the greedy choice is the same.
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0.3)
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


def test_own_storage_unshares_views():
    """Inductor's prepacking ignores storage offsets: weights sliced from one storage must become their own."""
    base = torch.arange(8.0)
    lin = torch.nn.Linear(2, 2, bias=False)
    lin.weight = torch.nn.Parameter(base[4:].view(2, 2))
    own_storage(lin)
    assert lin.weight.storage_offset() == 0 and lin.weight.untyped_storage().nbytes() == 16
    assert torch.equal(lin.weight, base[4:].view(2, 2))


def test_batch_buckets():
    assert [bucket(b, 32) for b in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert [bucket(b, 6) for b in (3, 5, 6)] == [4, 6, 6]


def test_bad_compile_argument(stories_dir):
    with pytest.raises(ValueError, match="compile must be"):
        build(stories_dir, compile="fast")
