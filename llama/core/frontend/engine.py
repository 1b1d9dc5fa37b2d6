"""The engine: the decode core behind a queue, served by a background thread, for requests that arrive at any
time from any thread (servers, batch jobs).

Cache ownership: while it has work the engine's thread holds the generator's KV cache (KVCache.lock), so other
calls on the same Llama (text_completion, prefill, score, chat sessions) wait until it is idle and can never
overwrite the slots of running requests.

Model parallel (world size > 1): rank 0 of each model-parallel group owns the queue, plans every step and
broadcasts the step's ops; the other ranks call `serve_forever()`, which replays them until rank 0 calls
`close()`. With pipeline stages global rank 0 leads every rank of the job, and the last stage's logits reach it
through the pipeline's forward pass. Sampling and text happen on rank 0 only; its RNG state is broadcast on close
so later calls agree across ranks. Which ranks replay the steps is the runner's Execution (llama/core/worker/runner.py).

Overlap (pipeline stages, on by default): the slots are split into one group per stage, whose steps are in flight
at once so the stages work on different groups at the same time (the pipeline's Execution.overlap). Only rank 0
decides: its first message moves the other ranks onto that protocol.
"""

import threading
from collections import deque
from typing import List, Optional

import torch
import torch.distributed as dist

from llama.core.frontend.request import Request


class EngineStopped(RuntimeError):
    """The engine's thread stopped on an error outside any one request: the request could not be served."""


class Engine:
    """Continuous batching over one Llama's KV cache. See the module docstring for the threading model."""

    HEARTBEAT = 60.0  # seconds between empty steps an idle model-parallel rank 0 sends (gloo/nccl time out)

    def __init__(self, llama, prefill_chunk: int = 128, overlap: Optional[bool] = None):
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        if overlap not in (None, True, False):
            raise ValueError(f"overlap must be True, False or None (on with pipeline stages), got {overlap!r}")
        self.llama = llama
        self.core = llama.core
        self._incoming: deque = deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.error: Optional[BaseException] = None  # what stopped the engine's thread, if something did
        self._released = threading.Event()  # set once close() is done; ends serve_forever on rank 0
        self._role, self._group, self._src = "single", None, 0
        execution = self.core.runner.execution
        if execution.lockstep is not None:  # tensor parallel: its group; pipeline stages: every rank, led by 0
            self._group, self._src = execution.lockstep
            self._role = "leader" if dist.get_rank() == self._src else "follower"
        self._pipe = None  # the groups whose steps overlap (rank 0 of a pipeline job)
        if self._role == "leader" and overlap is not False:
            self._pipe = execution.overlap(self.core, prefill_chunk)
        self.groups = self._pipe.groups if self._pipe else [self.core.scheduler(prefill_chunk)]
        self.scheduler = self.groups[0]
        if self._role == "leader":  # its idle heartbeats keep the other ranks' broadcast from timing out
            self._thread = threading.Thread(target=self._loop, name="llama-engine", daemon=True)
            self._thread.start()

    @property
    def slots(self) -> List[Optional[Request]]:
        return self.scheduler.slots if len(self.groups) == 1 else [r for g in self.groups for r in g.slots]

    @property
    def stats(self) -> dict:
        """The scheduler's counters (summed over the groups), with overlap: the Pipelined stats too."""
        if self._pipe is None:
            return self.scheduler.stats
        return {**{k: sum(g.stats[k] for g in self.groups) for k in self.scheduler.stats}, **self._pipe.stats}

    def submit(self, prompt, *, prefix=None, cache_salt: Optional[str] = "", **params) -> Request:
        """Queue a prompt (str or token ids) or a dialog (list of messages) with SamplingParams keywords.

        prefix: a Llama.prefill() Prefix that a text or token prompt continues (its cache is copied, not recomputed).
        cache_salt: prompts share cached prefix blocks only with prompts of the same salt (the server's per-API-key
        isolation); None: this request neither reuses nor leaves cached blocks.

        Never raises for a bad request: a prompt that cannot fit or bad parameters make result() raise, and the
        engine keeps serving the others.
        """
        return self.submit_samples(prompt, 1, prefix=prefix, cache_salt=cache_salt, **params)[0]

    def submit_samples(self, prompt, n: int, *, prefix=None, cache_salt: Optional[str] = "",
                       **params) -> List[Request]:
        """Queue n samples of one prompt (as submit), prompt prefilled once: the others copy its cache."""
        if self._role == "follower":
            raise RuntimeError(
                f"only model-parallel rank 0 accepts requests (global rank 0 with pipeline stages); this is rank "
                f"{dist.get_rank()}: call engine.serve_forever() here instead"
            )
        try:
            reqs = self.llama.inputs.samples(prompt, params, prefix, n)
        except (ValueError, TypeError) as e:
            return [self.llama.inputs.failed(e) for _ in range(n if isinstance(n, int) and n > 0 else 1)]
        if reqs[0].done():  # a refused dialog, answered with its error text
            return reqs
        for r in reqs:
            r.cache_salt = cache_salt
        with self._cv:
            for r in reqs:
                r.wake = self._wake
                if self._closed:
                    r.fail(self._closed_error())
                    r.settle(None)
            if self._closed:
                return reqs
            self._incoming.extend(reqs)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="llama-engine", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return reqs

    def close(self, cancel: bool = False) -> None:
        """Stop accepting requests, finish (or with cancel=True, cancel) the queued ones and stop the thread.

        Under model parallel this also releases the other ranks from serve_forever().
        """
        with self._cv:
            self._closed = True
            if cancel:
                for r in list(self._incoming) + [r for g in self.groups for r in list(g.waiting) + g.running()]:
                    r.cancelled = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self._role == "leader" and not self._released.is_set():
            states = {"cpu": torch.get_rng_state(), "pool": self.llama.cache.pool_state()}  # followers adopt both
            if torch.cuda.is_available():
                states["cuda"] = torch.cuda.get_rng_state()
            if self._pipe is not None:
                self._pipe.stop(states)
            else:
                self._broadcast({"stop": states})
        self._released.set()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)

    def serve_forever(self) -> None:
        """On model-parallel ranks other than 0: run rank 0's steps until it closes the engine. On rank 0 (or a
        single process): block until close() is called from another thread."""
        if self._role != "follower":
            self._released.wait()
            return
        while True:
            msg = self._broadcast(None)
            if "pipelined" in msg:  # rank 0 overlaps steps: follow its point-to-point messages until it stops
                with self.llama.cache.lock:
                    msg = {"stop": self.core.runner.execution.follow(self.core.runner, msg["pipelined"])}
            if "stop" in msg:
                torch.set_rng_state(msg["stop"]["cpu"])
                if "cuda" in msg["stop"] and torch.cuda.is_available():
                    torch.cuda.set_rng_state(msg["stop"]["cuda"])
                self.llama.cache.adopt_pool(msg["stop"]["pool"])  # it replayed rank 0's tables, not its planning
                return
            with self.llama.cache.lock, self.core.runner.leader_samples():
                self.core.runner.execute(msg["ops"])

    @property
    def alive(self) -> bool:
        """False once the engine's thread has stopped on an error (see `error`); it then refuses every request."""
        return self.error is None

    # ------------------------------------------------------------------------------------------------ internals
    def _closed_error(self) -> RuntimeError:
        if self.error is not None:
            return EngineStopped(f"the engine stopped after an error ({self.error!r}): create a new one with "
                                "Llama.engine()")
        return RuntimeError("the engine is closed: create a new one with Llama.engine()")

    def _die(self, error: BaseException) -> None:
        """Something outside any one request failed (a lost model-parallel peer, a bug): no step can be trusted any
        more, so every request in the engine fails with the cause, and later submissions are refused."""
        with self._cv:
            self.error, self._closed = error, True
            pending = list(self._incoming) + [r for g in self.groups for r in list(g.waiting) + g.running()]
            self._incoming.clear()
            for g in self.groups:
                g.waiting.clear()
                g.slots[:] = [None] * len(g.slots)
            if self._pipe is not None:
                self._pipe.inflight.clear()
            self._thread = None
            self._released.set()
            self._cv.notify_all()
        for r in pending:
            if not r.done():
                r.fail(EngineStopped(f"request {r.id} failed: the engine stopped after an error ({error!r})"))
                self.core.settle(r)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _work_locked(self) -> bool:
        return bool(self._incoming) or (self._pipe or self.scheduler).has_work()

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # requests' own errors are caught inside the step: this is the engine's
            self._die(e)

    def _serve(self) -> None:
        """The background thread: hold the cache while there is work, exit when idle.

        Under model parallel it stays until close(), sending an empty step every HEARTBEAT seconds while idle
        so the other ranks' waiting broadcast never reaches the process group's timeout.
        """
        broadcast = (lambda ops: self._broadcast({"ops": ops})) if self._role == "leader" else None
        if self._pipe is not None:
            self._broadcast(self._pipe.start())
        while True:
            with self._cv:
                idle = not self._work_locked()
                if idle and (self._role != "leader" or self._closed):
                    self._thread = None
                    self._cv.notify_all()
                    return
                if idle:
                    idle = not self._cv.wait(self.HEARTBEAT) and not self._work_locked() and not self._closed
            if idle:
                if self._pipe is not None:
                    self._pipe.beat()
                else:
                    self._broadcast({"ops": []})
                continue
            with self.llama.cache.lock, self.core.runner.leader_samples(deferred=self._pipe is not None):
                while True:
                    with self._cv:
                        self._take_incoming()
                    if not (self._pipe or self.scheduler).has_work():
                        break
                    if self._pipe is not None:
                        self._pipe.turn()
                    else:
                        self.core.step(self.scheduler, broadcast, publish=True)

    def _take_incoming(self) -> None:
        if self._pipe is not None:
            self._pipe.assign(self._incoming)
        else:
            self.scheduler.add(self._incoming)
        self._incoming.clear()

    def _broadcast(self, obj):
        objs = [obj]
        dist.broadcast_object_list(objs, src=self._src, group=self._group)
        return objs[0]
