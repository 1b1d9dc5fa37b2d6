"""prefix_cache="exact" computes every row by row-invariant arithmetic (llama/kernels/invariant.py): a position's
logits, keys and values are bitwise the same whether its prompt's earlier positions were computed in the same pass,
in earlier chunks of any size, or came from blocks another pass wrote (the cache), over any KV length and beside any
other rows, in fp32 and bf16; and a decode step's row equals a prefill's."""

import pytest
import torch
from conftest import STORIES, need

from llama.core.scheduling.plan import Decode, Prefill, SetBlocks
from llama.kernels import dense, invariant

PROMPT = [1] + [(7 * i * i + 3 * i + 11) % 500 + 5 for i in range(70)]  # 71 tokens: 4 full blocks and a part
OTHER = [1] + [(5 * i + 2) % 480 + 20 for i in range(120)]


def build(mode, dtype):
    from llama import Llama

    d = str(need(STORIES))
    return Llama.build(d, d + "/tokenizer.model", max_seq_len=256, max_batch_size=6, prefix_cache=mode, dtype=dtype)


class Rows:
    """Prefill passes and decode steps through the runner, each cache row with blocks of its own from the pool."""

    def __init__(self, llm):
        self.llm, self.pool = llm, llm.cache.pool
        self.blocks = {}

    def give(self, row, shared=()):
        own = self.pool.allocate(self.pool.blocks_for(256) - len(shared))
        self.blocks[row] = list(shared) + own
        self.llm.runner.execute([SetBlocks(rows=[row], blocks=[self.blocks[row]])])

    def prefill(self, rows, chunks, starts):
        """Every position's logits of one pass: chunks[i] at starts[i] in row rows[i], right-padded."""
        width = max(map(len, chunks))
        op = Prefill(tokens=[c + [0] * (width - len(c)) for c in chunks], start=starts, rows=rows, last=None,
                     kv_len=max(starts) + width)
        return self.llm.runner.execute([op])[0]

    def decode(self, row, token, pos):
        op = Decode(tokens=[0] * row + [token], pos=[0] * row + [pos], active=[row])
        return self.llm.runner.execute([op])[0][row]


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def exact(request):
    llm = build("exact", request.param)
    yield llm
    llm.cache.pool.clear()


def test_a_position_is_computed_alike_in_every_pass(exact):
    rows = Rows(exact)
    n = len(PROMPT)
    rows.give(0)
    whole = rows.prefill([0], [PROMPT], [0])[0]  # (71, V): the prompt in one pass
    rows.give(1)  # chunks of other sizes, the first a single token (the decode path's shape)
    got, s = [], 0
    for c in (1, 16, 5, 1, 30, n):
        chunk = PROMPT[s : s + c]
        if chunk:
            got.append(rows.prefill([1], [chunk], [s])[0])
            s += len(chunk)
    assert torch.equal(torch.cat(got), whole)
    rows.give(2, shared=rows.blocks[0][:3])  # cached: its first 48 positions are row 0's blocks
    assert torch.equal(rows.prefill([2], [PROMPT[48:]], [48])[0], whole[48:])
    # beside a longer companion: a longer KV length, padding, another start
    rows.give(3)
    rows.give(4)
    both = rows.prefill([3, 4], [PROMPT[:40], OTHER[:90]], [0, 0])
    assert torch.equal(both[0, :40], whole[:40])
    both = rows.prefill([4, 3], [OTHER[90:], PROMPT[40:]], [90, 40])
    assert torch.equal(both[1, : n - 40], whole[40:])
    rows.give(5)  # a decode step's row is a prefill's: the last prompt token decoded after the rest prefilled
    rows.prefill([5], [PROMPT[:-1]], [0])
    assert torch.equal(rows.decode(5, PROMPT[-1], n - 1), whole[-1])


def test_products_and_silu_are_row_invariant_at_any_row_count():
    """What the exact mode's passes rest on, where the default path is not invariant (dense.py: oneDNN's GEMM and
    our kernel by row count; SiLU's vectorized and scalar exp)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(384, 2048, generator=g).to(dtype)
        x = torch.randn(80, 2048, generator=g).to(dtype)
        gate = torch.randn(80, 172, generator=g).to(dtype) * 3
        with invariant.rows():
            full, act = dense.linear(x, w), invariant.silu(gate)
            for m in (1, 5, 9, 17, 38):  # a row alone, as in a batch of 80
                assert torch.equal(dense.linear(x[:m], w), full[:m]), (dtype, m)
                assert torch.equal(invariant.silu(gate[m : m + 1]), act[m : m + 1]), (dtype, m)
