"""Asynchronous decoding: the next one-token step is queued on the device before the host reads this step's tokens.

On a GPU the host spends about a millisecond per step in Python (advancing the requests, stop strings, streams, the
next plan), and a synchronous loop leaves the GPU idle meanwhile. Here, once a decode step's tokens are drawn on the
device, the runner queues the step that feeds them back (same requests and slots, next positions) and only then
copies the tokens to the host, which advances the requests and plans the next step while the GPU runs it. When that
plan comes, the queued step stands in for its Decode op if it is the step the plan asks for (the same shape, each
planned row's token and position); otherwise it is dropped and the plan runs as usual. So stop checks, stop strings
and streaming act one step behind, as in vLLM's asynchronous scheduling, while the decode core still decides every
step: the outputs are those of synchronous decoding, bit for bit (tests/core/worker/test_ahead.py).

A step is queued only when it is one the plan could ask for: every request has a token left to generate and a
position left in the cache, and the position it writes lies in a block it already holds. A dropped step's writes
therefore land in positions of its own rows that a later step rewrites before anything reads them. So that steps
crossing into a new block are queued too, the paged pool hands each decoding request the block its next step
writes one step early (`Paging.lookahead`); the plan that grants it may still use the queued step, as a grant only
extends a row's table past what that step reads and writes.

Only requests drawn wholly on the device take part: no logits processors, grammar, penalties or top_logprobs (they
read the host's token lists or return host lists), and no speculation; a step with any other request runs
synchronously. One stage only: a single process, or tensor-parallel ranks decoding in lockstep (each gets the same
logits, draws the same tokens and queues the same step, collectives included, in the same order), but not while
the engine serves under tensor parallel, whose followers replay the leader's ops, nor on pipeline stages.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from llama import settings
from llama.core.scheduling.plan import Decode, Op, Plan, SetBlocks
from llama.core.frontend.request import Request


def enabled(device: torch.device, alone: bool) -> bool:
    """LLAMA_ASYNC_DECODE: on, off, or unset (auto: on for one stage on CUDA, where the GPU runs ahead of the
    host; on a CPU the step runs in the calling thread, so queueing it early gains nothing). alone: one stage."""
    choice = settings.get().async_decode
    if choice is None:
        return alone and torch.device(device).type == "cuda"
    return choice and alone


def drawn_on_device(r: Request) -> bool:
    """Whether a request's next token needs nothing from the host but its parameters."""
    p = r.params
    return not p.logits_processors and r.matcher is None and not p.transforms and not p.top_logprobs


def eligible(plan: Plan) -> bool:
    """A plan whose only forward pass is one Decode op over requests drawn on the device."""
    if plan.prefill or plan.twins or plan.verifying or not plan.decoding:
        return False
    if sum(isinstance(op, Decode) for op in plan.ops) != 1 or any(
            not isinstance(op, (Decode, SetBlocks)) for op in plan.ops):
        return False
    return all(drawn_on_device(r) for r in plan.decoding)


def next_step(op: Decode, reqs: Sequence[Request], max_seq_len: int, block: int) -> Optional[Decode]:
    """The Decode op the next plan asks for if every request goes on (tokens still the dummy ones), or None when
    some request cannot: its last token, the end of the cache, or a position past the blocks it holds."""
    pos = list(op.pos)
    for r in reqs:
        nxt = op.pos[r.slot] + 1
        if len(r.generated) + 2 > r.max_new or nxt >= max_seq_len or (block and nxt >= len(r.blocks) * block):
            return None
        pos[r.slot] = nxt
    return Decode(tokens=list(op.tokens), pos=pos, active=list(op.active), base=op.base)


@dataclass
class Queued:
    """A decode step launched ahead of its plan: its op (tokens filled in once the host has them), its logits, the
    shape of its pass (a plan's step of another shape would round differently), and the blocks each of its cache
    rows held when it was queued."""

    op: Decode
    logits: torch.Tensor
    shape: Tuple
    held: Dict[int, Tuple[int, ...]] = field(default_factory=dict)

    def take(self, ops: List[Op], shape: Callable[[Decode], Tuple]) -> Optional[int]:
        """The index of the Decode op among ops if this step can stand in for it, else None. Besides that op, a plan
        may only clear the tables of rows that were left, or extend a row's table past the blocks it held (both
        done after this step's writes, which is harmless)."""
        found = None
        for i, op in enumerate(ops):
            if isinstance(op, Decode) and found is None:
                found = i
            elif not (isinstance(op, SetBlocks) and all(map(self._keeps, op.rows, op.blocks))):
                return None
        if found is None:
            return None
        d, q = ops[found], self.op
        if d.base != q.base or len(d.tokens) != len(q.tokens) or not set(d.active) <= set(q.active):
            return None
        if any(d.tokens[s] != q.tokens[s] or d.pos[s] != q.pos[s] for s in d.active):
            return None
        return found if shape(d) == self.shape else None

    def _keeps(self, row: int, blocks: Sequence[int]) -> bool:
        """Whether a table edit leaves what this step read and wrote: a cleared row, or the row's blocks extended."""
        held = self.held.get(row)
        return not blocks or (held is not None and tuple(blocks[: len(held)]) == held)


def to_host(tensors: Sequence[Optional[torch.Tensor]]) -> Tuple[list, Callable[[], None]]:
    """Start copying small device tensors to the host; (the copies, a wait for them). On CUDA the copies go to
    pinned memory behind the kernels already queued, so the wait does not include work queued after this call."""
    if not any(t is not None and t.is_cuda for t in tensors):
        return [None if t is None else t.cpu() for t in tensors], lambda: None
    copies = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
    done = torch.cuda.Event()
    done.record()
    return copies, done.synchronize
