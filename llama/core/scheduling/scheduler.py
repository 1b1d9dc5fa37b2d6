"""The scheduler: pure slot and queue state that plans each step of the decode core.

A step admits waiting requests into free cache slots, loads their prefix's cached positions, moves requests into
lower free slots when no one waits (so the decode pass reads slots 0..B-1 in place), hands out at most
`prefill_chunk` prompt tokens (oldest requests first, so one long prompt does not stall everyone else), copies a
finished prompt's cache to its twins (the n samples of one prompt are prefilled once), and decodes one token for
every request that has one to feed. It computes nothing itself: the plan's ops (llama/core/scheduling/plan.py) are plain
data, so model-parallel rank 0 can send them to the other ranks.

A scheduler may own a range of the cache's slots that starts past 0 (`base`): the pipelined engine runs one
scheduler per group of slots. Requests keep slot numbers local to their scheduler; the ops name the cache's
rows.

With a paged KV pool (`pool`, llama/core/scheduling/paging.py) a request is admitted when its prompt's blocks are free, starts
after the longest cached prefix of its prompt, gets blocks as it writes, moves by a table edit instead of a copy,
and shares its twins' prompt blocks; when the pool runs dry the most recently admitted request is preempted (back
to the front of the queue, recomputed when re-admitted, and no newcomer is admitted in that step). Admission is
first come, first served, not cache-aware: preferring cached prompts would reorder the queue by what else ran, and
a request's wait (unlike its text) would then depend on other tenants' traffic.
"""

import itertools
from collections import deque
from typing import Iterable, List, Optional

from llama.core.frontend.request import Request
from llama.core.scheduling.paging import Paging
from llama.core.scheduling.plan import CopyRows, Decode, LoadPrefix, Plan, Prefill


def new_stats() -> dict:
    """A scheduler's counters (the engine reports them; a speculator adds its own)."""
    return {"steps": 0, "forwards": 0, "admitted": 0, "finished": 0, "generated_tokens": 0, "prefill_tokens": 0,
            "peak_active": 0, "moves": 0, "preemptions": 0}


class Scheduler:
    def __init__(self, max_batch_size: int, max_seq_len: int, prefill_chunk: int, base: int = 0, pool=None,
                 lookahead: int = 0, stats: Optional[dict] = None, speculator=None):
        """pool: the paged KV pool (None: rows of max_seq_len positions), reached `lookahead` steps ahead
        (Paging); stats: the counters to keep (shared with the speculator); speculator: what drafts for this
        scheduler's requests (llama/core/speculation/speculative.py), run by the decode core after each plan."""
        self.slots: List[Optional[Request]] = [None] * max_batch_size
        self.base = base  # cache row of slot 0
        self.paging = None if pool is None else Paging(pool, base, max_seq_len, lookahead)
        self.max_seq_len, self.prefill_chunk = max_seq_len, prefill_chunk
        self.waiting: deque = deque()
        self.stats = new_stats() if stats is None else stats
        self._order = itertools.count()
        self.speculator = speculator

    def add(self, requests: Iterable[Request], longest_first: bool = False) -> None:
        """Queue requests. longest_first (offline work, all known up front): admit the longest max_new first, so
        a long request never starts last and keeps one slot busy alone at the end."""
        requests = list(requests)
        self.waiting.extend(sorted(requests, key=lambda r: -r.max_new) if longest_first else requests)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def running(self) -> List[Request]:
        return [r for r in self.slots if r is not None]

    def drop_cancelled(self) -> List[Request]:
        """Take cancelled requests out of the queue and their slots."""
        out = [r for r in self.waiting if r.cancelled]
        for r in out:
            self.waiting.remove(r)
        for r in self.running():
            if r.cancelled:
                self.retire(r)
                out.append(r)
        return out

    def retire(self, r: Request) -> None:
        if 0 <= r.slot < len(self.slots) and self.slots[r.slot] is r:
            self.slots[r.slot] = None
            self.stats["finished"] += 1
            self.stats["generated_tokens"] += len(r.generated)
            if self.paging is not None:
                self.paging.retired(r)
        r.first_logits = None

    # ------------------------------------------------------------------------------------------ planning
    def plan(self) -> Plan:
        plan = Plan()
        preempted = self.stats["preemptions"]
        if self.paging is not None:  # blocks for this step's decoding, preempting if the pool is dry
            plan.ops += self.paging.grow(self)
        if self.stats["preemptions"] == preempted:  # a step that had to preempt has no room for newcomers
            self._admit(plan)
        self._compact(plan)
        self._plan_prefill(plan)
        plan.decoding = [r for r in self.slots if r is not None and r.feed is not None]
        if plan.decoding:
            plan.ops.append(self._decode_op())
        return plan

    def draft_budget(self, plan: Plan) -> int:
        """The drafted tokens a step has room for: its prefill budget left (drafted tokens count against it)."""
        return self.prefill_chunk - sum(c for _, _, c in plan.prefill)

    def _admit(self, plan: Plan) -> None:
        """Fill free slots in queue order. The samples of one prompt are admitted together (if they can ever fit),
        so they share one prefill; a group that must wait holds back the queue behind it (first come, first
        served)."""
        free = [s for s, r in enumerate(self.slots) if r is None]
        while self.waiting and free:
            group = [self.waiting[0]]
            for r in itertools.islice(self.waiting, 1, None):
                if r.twin is not group[0]:
                    break
                group.append(r)
            if len(free) < len(group) <= len(self.slots):
                break
            group = group[: len(free)]
            if self.paging is None:
                for _ in group:
                    self._place(self.waiting.popleft(), free.pop(0), plan)
                continue
            placed = self.paging.reserve(group, nothing_runs=not self.running())
            if not placed:  # its blocks are not free yet: it waits, and so does the queue behind it
                break
            for r, blocks, cached in placed:
                self.waiting.popleft()
                s = free.pop(0)
                plan.ops.append(self.paging.admitted(r, self.base + s, blocks, cached))
                self._place(r, s, plan)
        self.stats["peak_active"] = max(self.stats["peak_active"], len(self.running()))

    def _place(self, r: Request, s: int, plan: Plan) -> None:
        r.slot, r.order = s, next(self._order)
        if r.prefix is not None:  # the prompt continues a Llama.prefill() prefix: load its positions
            n = r.prefix.reusable(r.prompt)
            if n:
                plan.ops.append(LoadPrefix(prefix=r.prefix.id, row=self.base + s, length=n))
                if r.params.scores_prompt:
                    r.prompt_logprobs = r.prefix.prompt_logprobs(r.prompt, n)
            r.prefilled = r.reused = n
        self.slots[s] = r
        self.stats["admitted"] += 1

    def _source(self, r: Request) -> Optional[Request]:
        """The live request whose prompt cache r can copy: its twin, or whoever took over from it."""
        src = r.twin
        while src is not None and not (src.slot >= 0 and self.slots[src.slot] is src):
            src = src.successor
        return src

    def _compact(self, plan: Plan) -> None:
        """With no one waiting, move requests from the highest slots into free lower ones.

        The decode pass runs over slots 0..B-1 (B = highest busy slot + 1) so it reads the cache without a
        gather; a gap below a busy slot costs a dummy row every step. Moving a request copies its cached
        positions once.
        """
        if self.waiting:
            return
        src, dst, length = [], [], 0
        while True:
            free = [s for s, r in enumerate(self.slots) if r is None]
            busy = [s for s, r in enumerate(self.slots) if r is not None]
            if not free or not busy or free[0] > busy[-1]:
                break
            r = self.slots[busy[-1]]
            self.slots[busy[-1]], self.slots[free[0]] = None, r
            src.append(busy[-1])
            dst.append(free[0])
            r.slot = free[0]
            length = max(length, r.next_pos if r.feed is not None else r.prefilled)
            if self.paging is not None:
                plan.ops.append(self.paging.moved(r, self.base + src[-1], self.base + dst[-1]))
        if src and self.paging is not None:
            self.stats["moves"] += len(src)
        elif src and length:
            self.stats["moves"] += len(src)
            plan.ops.append(CopyRows(src=self._rows(src), dst=self._rows(dst), length=length))

    def _plan_prefill(self, plan: Plan) -> None:
        """Prompt chunks for this step, oldest requests first, prefill_chunk tokens in all; twins whose source has
        its whole prompt cached get a copy of it (after the prefill ops) instead."""
        budget, twins = self.prefill_chunk, []
        for r in sorted(self.running(), key=lambda r: r.order):
            n = len(r.context) - r.prefilled
            if n <= 0:
                continue
            src = self._source(r)
            if src is not None:
                if src.prefilled >= len(src.prompt):  # done, or done by a chunk planned above in this step
                    twins.append((r, src))
                    r.prefilled = len(r.prompt)
                continue  # else wait for it: it is older, so it gets the budget first
            if r.twin is not None:  # every source has left: compute the prompt, and serve the remaining twins
                last = r.twin
                while last.successor is not None:
                    last = last.successor
                last.successor, r.twin, r.has_twins = r, None, True
            if budget > 0:
                c = min(n, budget)
                plan.prefill.append((r, r.prefilled, c))
                r.prefilled += c
                budget -= c
                if self.paging is not None:
                    self.paging.prefilled(r)
        plan.ops += self._prefill_ops(plan.prefill)
        for r, src in twins:
            if self.paging is not None:
                plan.ops += self.paging.share(r, src, self.base + r.slot)
                continue
            plan.ops.append(CopyRows(src=self._rows([src.slot]), dst=self._rows([r.slot]), length=len(r.prompt)))
        plan.twins = twins

    def _prefill_ops(self, jobs: List) -> List[Prefill]:
        """Padded (rows, width) forward passes; a group's padding never reaches past max_seq_len."""
        groups: List[List] = []
        for job in jobs:
            g = groups[-1] if groups else None
            if g is not None and max(s for _, s, _ in g + [job]) + max(c for _, _, c in g + [job]) <= self.max_seq_len:
                g.append(job)
            else:
                groups.append([job])
        ops = []
        for g in groups:
            width = max(c for _, _, c in g)
            starts = [s for _, s, _ in g]
            full = any(r.params.scores_prompt for r, _, _ in g)
            ops.append(Prefill(
                tokens=[r.context[s : s + c] + [0] * (width - c) for r, s, c in g],
                start=starts[0] if len(set(starts)) == 1 else starts,
                rows=self._rows([r.slot for r, _, _ in g]),
                last=None if full else [c - 1 for _, _, c in g],
                kv_len=max(starts) + width,
            ))
            self.stats["prefill_tokens"] += sum(c for _, _, c in g)
        return ops

    def _decode_op(self) -> Decode:
        """One token for every decoding slot. The runner decodes over slots 0..B-1 in place, so slots in that range
        that are not decoding get a dummy token at a position no one has filled yet (their next prefill position,
        or 0 for a free slot), which is always rewritten before it is read."""
        tokens, pos, active = [0] * len(self.slots), [0] * len(self.slots), []
        for s, r in enumerate(self.slots):
            if r is None:
                continue
            if r.feed is not None:
                tokens[s], pos[s] = r.feed, r.next_pos
                active.append(s)
            else:
                pos[s] = r.prefilled
        return Decode(tokens=tokens, pos=pos, active=active, base=self.base)

    def _rows(self, slots: List[int]) -> List[int]:
        """Cache rows of local slot numbers."""
        return [self.base + s for s in slots]
