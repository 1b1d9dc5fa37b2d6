"""The decode core: one step = the scheduler's plan, the runner's forward passes and samples, then retiring what
finished. Static batches, streams, chat sessions and the engine all run through `DecodeCore.step`; a static
batch is a scheduler with every request queued at once.
"""

from concurrent.futures import CancelledError
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from llama.config.options import SchedulerConfig
from llama.core.frontend.request import Request
from llama.core.scheduling.plan import FORWARD, Plan
from llama.core.worker.runner import Runner
from llama.core.scheduling.scheduler import Scheduler, new_stats
from llama.core.speculation.speculative import Memory, Speculator


class DecodeCore:
    def __init__(self, runner: Runner, settle: Callable[[Request], None], scheduler: SchedulerConfig,
                 speculative: Optional[str] = None, predictions: bool = False, drafter=None):
        """speculative: "ngram" or "draft" (its schedulers draft; llama/core/speculation/speculative.py); predictions: whether
        requests' predicted outputs are drafted from (the decode step verifies exactly); drafter: the DraftModel
        under "draft" (llama/core/speculation/draft_model.py)."""
        self.runner, self.settle = runner, settle
        self.max_batch_size, self.max_seq_len = scheduler.max_batch_size, scheduler.max_seq_len
        self.speculative, self.predictions, self.drafter = speculative, predictions, drafter
        self.drafting = Memory()  # what its schedulers' speculators learned (step times, acceptance)

    def scheduler(self, prefill_chunk: Optional[int] = None, slots: Optional[range] = None) -> Scheduler:
        """Fresh slot state; without a chunk limit every prompt is prefilled in the step that admits it. slots: the
        cache rows it owns (default all of them; the pipelined engine gives each of its groups a range)."""
        slots = range(self.max_batch_size) if slots is None else slots
        chunk = prefill_chunk or len(slots) * self.max_seq_len
        pool = self.runner.cache.pool
        stats, speculator = new_stats(), None
        if self.speculative is not None or self.predictions:
            block = pool.block_size if pool is not None else 0
            speculator = Speculator(stats, slots.start, self.max_seq_len, block, self.speculative, self.drafting,
                                    self.drafter)
        # a step queued ahead needs its block already (llama/core/worker/ahead.py)
        return Scheduler(len(slots), self.max_seq_len, chunk, base=slots.start, pool=pool,
                         lookahead=int(self.runner.run_ahead), stats=stats, speculator=speculator)

    def step(self, sched: Scheduler, broadcast: Optional[Callable] = None,
             publish: bool = False) -> List[Tuple[Request, str]]:
        """One step; returns the text deltas it produced. broadcast(ops) reaches model-parallel followers first;
        publish puts deltas on the requests' own streams (for callers iterating a request)."""
        idle, admitted = not sched.running(), sched.stats["admitted"]
        deltas = self.finish(sched, *self.launch(sched, broadcast), publish=publish)
        if idle and sched.waiting and not sched.running() and sched.stats["admitted"] == admitted:
            self._unfit(sched)
        return deltas

    def launch(self, sched: Scheduler, broadcast: Optional[Callable] = None) -> Tuple[Plan, Optional[list]]:
        """The first half of a step: plan it and start its forward passes; (plan, their outputs, or None if they
        failed). The pipelined engine launches another group's step before finishing this one."""
        for r in sched.drop_cancelled():
            r.fail(CancelledError(f"request {r.id} was cancelled"), "cancelled")
            self.settle(r)
        if sched.paging is not None:
            self.runner.cache.drain()  # blocks of prefixes dropped since the last step go back to the pool
        plan = sched.plan()
        if sched.speculator is not None and plan.decoding:  # drafting: a step of its own, after planning
            sched.speculator.plan(plan, budget=sched.draft_budget(plan))
        outs: Optional[list] = []
        if plan.ops:
            if broadcast is not None:
                broadcast(plan.ops)
            try:
                compiles = self.runner.compiles()
                outs = self.runner.execute(plan.ops)
                if sched.speculator is not None and self.runner.compiles() != compiles:
                    sched.speculator.times.skip()  # a compile's seconds are not the step's cost
            except Exception as e:  # the cache state is unknown: fail the running requests, keep serving
                self._fail(sched, e)
                outs = None
        return plan, outs

    def finish(self, sched: Scheduler, plan: Plan, outs: Optional[list],
               publish: bool = False) -> List[Tuple[Request, str]]:
        """The second half: sample from the launched passes' logits, advance the requests, retire what finished."""
        deltas = []
        if plan.ops:
            if outs is not None:
                try:
                    deltas = self.runner.complete(plan, outs, ahead_ok=self._steady(sched))
                except Exception as e:
                    self._fail(sched, e)
                for r, draft, n in plan.accepted:  # what verifying found, for the speculator's estimates
                    sched.speculator.accepted(r, draft, n)
            sched.stats["steps"] += 1
            sched.stats["forwards"] += sum(isinstance(op, FORWARD) for op in plan.ops)
        if publish:
            for r, text in deltas:
                r.put(text)
        for r in sched.running():
            if r.finished:
                sched.retire(r)
                self.settle(r)
        return deltas

    def _steady(self, sched: Scheduler) -> bool:
        """Whether the next plan is likely this step's continuation: nothing that may draft (prompt lookup, or a
        running request's prediction), and no one waiting for a slot that is free (an admission would change the
        next step). Then the runner may queue it ahead."""
        drafts = sched.speculator is not None and (
            self.speculative is not None or any(r.params.prediction for r in sched.running()))
        return not drafts and not (sched.waiting and None in sched.slots)

    @staticmethod
    def _fail(sched: Scheduler, e: Exception) -> None:
        for r in sched.running():
            r.fail(RuntimeError(f"request {r.id} failed: {e!r}"))
        if sched.paging is not None:  # blocks keyed this step may never have been written
            sched.paging.pool.clear()

    def run(self, requests: Sequence[Request]) -> Iterator[List[Tuple[Request, str]]]:
        """Run requests to completion in this thread (the caller holds the cache): per step, the text deltas.

        When they fit the cache they are all admitted at once; otherwise a slot goes to the next request as soon
        as one frees up, longest first.
        """
        sched = self.scheduler()
        sched.add(requests, longest_first=len(requests) > self.max_batch_size)
        try:
            while sched.has_work():
                yield self.step(sched)
        finally:  # the caller stopped early (a stream closed or dropped): cancel the rest, give its blocks back
            self._abandon(sched)

    def _abandon(self, sched: Scheduler) -> None:
        for r in list(sched.waiting) + sched.running():
            if not r.finished:
                r.fail(CancelledError(f"request {r.id} was cancelled: its caller stopped reading"), "cancelled")
            sched.retire(r)
            self.settle(r)
        sched.waiting.clear()

    def _unfit(self, sched: Scheduler) -> None:
        """Nothing runs and the next request still was not admitted: its blocks will never be free, because live
        prefixes (Llama.prefill, chat sessions) hold the rest of the pool. Fail what waits rather than spin (the
        pipelined engine's groups share the pool, so one idle group may wait for another's: not checked there)."""
        if sched.paging is None:
            return
        pool = sched.paging.pool
        for r in list(sched.waiting):
            r.fail(ValueError(
                f"request {r.id} needs {sched.paging.need(r)} KV blocks and the pool has {pool.available()} of "
                f"{pool.num_blocks} available; live prefixes and chat sessions hold {pool.used()}: close() or drop "
                "some, or build the Llama with a larger kv_cache_memory"))
            self.settle(r)
        sched.waiting.clear()
