"""Speculative decoding that never changes an output: draft a few tokens cheaply, check them in one forward pass.

Why it is exact. A request's k drafted tokens go through a Verify pass (llama/core/plan.py) together with its last
token: k+1 rows of a decode step that share the request's cache row at positions p..p+k. Our CPU decode kernels
compute every row of a batch independently and write every row's key and value before any row attends, each row
attending only up to its own position, so row i's logits are bit for bit those a one-token step at position p+i
would give. Then each position is sampled exactly as plain decoding samples it (Runner.sample: logits processors,
grammar mask, penalties, the seeded draw for that token index, logprobs, stop strings, max_tokens), one position
after another, and only while the sampled token equals the draft: position i+1 is sampled after token i was
accepted, so processors and the grammar see accepted prefixes only, in order, and never a rejected token (nothing
to roll back). The first sample that differs from the draft is kept too (it is what plain decoding would sample
there), so a step emits 1..k+1 tokens. The rejected positions' keys and values stay in the request's blocks past
its length: the next step writes over them before anything reads them, and no block is keyed for the prefix cache
beyond the accepted tokens (Request.cached). An unseeded request samples from the same distributions, with the
global generator drawn in another order: identical in distribution, not in draws.

When it is used (Speculator, one per scheduler; thresholds below):
- only with the eager decode step (Llama.build(speculative=...) decodes eagerly: a compiled step rounds otherwise);
- per request, unless its SamplingParams say speculative=False, and only where prompt lookup finds a draft;
- per step, only while at most MAX_BATCH requests decode (past that a batch already reads each weight for several
  tokens, and verification costs more than it saves: llama.cpp measured 0.77x at 8 slots), in one pass of at most
  MAX_ROWS rows (our fp32 kernel takes at most 8 rows: llama/kernels/dense.py), every decoding request in it.
- k adapts per request: doubled (up to K_MAX) when a whole draft is accepted, set to accepted+1 after a partial
  one, halved after a miss; at 0 the request decodes plainly for PAUSE steps, then tries k=1 again.
"""

import weakref
from typing import Callable, List, Tuple

import torch

from llama.core.plan import Decode, Plan, Verify
from llama.core.request import Request
from llama.sample.lookup import NgramIndex

MODES = ("ngram",)
MAX_BATCH = 4  # decoding requests in a step past which no one drafts
MAX_ROWS = 8  # rows of one Verify pass (the drafting requests' k+1, one for each other decoding request)
K_START, K_MAX = 4, 7  # draft length a request starts at, and its ceiling (k+1 <= MAX_ROWS)
PAUSE = 16  # steps a request decodes plainly after its k fell to 0


def check_mode(mode) -> "str | None":
    if mode in (None, False, "off"):
        return None
    if mode not in MODES:
        raise ValueError(f"speculative must be None, 'off' or one of {', '.join(map(repr, MODES))}, got {mode!r}")
    return mode


class _State:
    """One request's drafting state: its n-gram index and adaptive draft length."""

    def __init__(self):
        self.index, self.k, self.pause = NgramIndex(), K_START, 0


class Speculator:
    """Drafts for a scheduler's decoding requests and turns its step's Decode op into a Verify op (Scheduler.plan
    calls it last); told by the runner how many drafted tokens each request accepted."""

    def __init__(self, stats: dict, base: int, max_seq_len: int, block_size: int = 0):
        self.stats, self.base, self.max_seq_len, self.block_size = stats, base, max_seq_len, block_size
        for key in ("verify_steps", "drafted_tokens", "accepted_tokens"):
            stats.setdefault(key, 0)
        self._states: "weakref.WeakKeyDictionary[Request, _State]" = weakref.WeakKeyDictionary()

    def _draft(self, r: Request, budget: int) -> List[int]:
        if not getattr(r.params, "speculative", True) or r.feed is None:
            return []
        st = self._states.get(r)
        if st is None:
            st = self._states[r] = _State()
        if st.pause:
            st.pause -= 1
            if not st.pause:
                st.k = 1
            return []
        # room: the step emits at most k+1 tokens of max_new, and writes positions up to next_pos + k, within the
        # cache and the blocks the request holds (a draft never takes a block of its own)
        end = self.max_seq_len
        if self.block_size and r.blocks:
            end = min(end, len(r.blocks) * self.block_size)
        k = min(st.k, budget, r.max_new - len(r.generated) - 1, end - 1 - r.next_pos)
        return st.index.draft(r.prompt + r.generated, k)

    def plan(self, plan: Plan) -> None:
        """Draft for plan.decoding; where any draft is found, verify every decoding request in one pass instead of
        the Decode op."""
        decoding = plan.decoding
        if not decoding or len(decoding) > MAX_BATCH:
            return
        budget, drafts = MAX_ROWS - len(decoding), {}
        for r in sorted(decoding, key=lambda r: r.order):
            d = self._draft(r, budget)
            if d:
                drafts[r] = d
                budget -= len(d)
        if not drafts:
            return
        plan.ops = [op for op in plan.ops if not isinstance(op, Decode)]
        tokens: List[int] = []
        pos: List[int] = []
        rows: List[int] = []
        for r in decoding:
            d = drafts.get(r, [])
            tokens += [r.feed] + d
            pos += range(r.next_pos, r.next_pos + len(d) + 1)
            rows += [self.base + r.slot] * (len(d) + 1)
        plan.ops.append(Verify(tokens=tokens, pos=pos, rows=rows))
        plan.verifying = [(r, drafts.get(r, [])) for r in decoding]
        plan.decoding, plan.speculation = [], self
        self.stats["verify_steps"] += 1

    def accepted(self, r: Request, draft: List[int], n: int) -> None:
        """r accepted the first n tokens of its draft: adapt its k."""
        if not draft:
            return
        self.stats["drafted_tokens"] += len(draft)
        self.stats["accepted_tokens"] += n
        st = self._states.get(r)
        if st is None:
            return
        if n == len(draft):
            st.k = min(2 * st.k, K_MAX)
        elif n:
            st.k = n + 1
        else:
            st.k //= 2
            if not st.k:
                st.pause = PAUSE


def verify(forward: Callable, op: Verify, device) -> torch.Tensor:
    """Logits (rows, V) of a Verify op: one decode pass over its rows, each at its own position and cache row."""
    x = torch.tensor(op.tokens, device=device)[:, None]
    return forward(x, torch.tensor(op.pos, device=device), rows=torch.tensor(op.rows, device=device))[:, 0]


def accept(sample: Callable, plan: Plan, logits: torch.Tensor,
           ready: List[Tuple[Request, torch.Tensor]]) -> List[Tuple[Request, str]]:
    """Sample the verified positions in order, each through sample() (the runner's, the one plain decoding uses),
    while each request's sampled token equals its draft; returns the text deltas, in order per request."""
    first, at = [], 0
    for r, d in plan.verifying:
        first.append(at)
        at += len(d) + 1
    deltas = sample(ready + [(r, logits[f]) for (r, _), f in zip(plan.verifying, first)])
    live = [(r, d, f) for (r, d), f in zip(plan.verifying, first)]
    i = 0
    while live:
        going = []
        for r, d, f in live:
            if i < len(d) and not r.finished and r.feed == d[i]:
                going.append((r, d, f))
            elif plan.speculation is not None:
                plan.speculation.accepted(r, d, i)
        if going:
            deltas += sample([(r, logits[f + i + 1]) for r, _, f in going])
        live, i = going, i + 1
    return deltas
