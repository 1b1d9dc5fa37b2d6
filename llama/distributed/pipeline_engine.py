"""Decode steps that overlap across pipeline stages: the engine keeps up to P groups of requests in flight.

With P stages one step of a batch occupies each stage in turn, and the next step cannot start before the step's
tokens are back, so each stage would idle (P - 1) / P of the time. Here the engine splits its cache slots into
P groups (vLLM's "virtual engines"), each a Scheduler over its own consecutive slots (disjoint cache rows of the
one KVCache, which the engine's thread holds). Rank 0 launches group A's step (its plan, then the first stage's
part of its forward passes; the logits come back later as a Pending), then group B's step while A is on the later
stages, and only then finishes A (waits for its logits, samples, retires). A group's next step is planned once
its own tokens are back; the other groups' steps fill the pipeline meanwhile. Launch and finish are the decode
core's two halves of DecodeCore.step, so the scheduler and the core stay the only loop.

Messages: rank 0 sends each step's ops to every other rank point to point (non-blocking isend with their own
tag): a broadcast would wait for a stage still busy with an earlier step. Every rank runs the ops it gets in
order, so the stages' hidden-state sends and receives and the last stage's logits (sent to the first stage)
match in order. The other ranks of the first stage (T > 1) also get a "finish" message, so they wait for the
same logits and all-gather them in the same order as rank 0. Sends are waited for only once their step is known
to be done (Outbox tickets): a send must not hold its stage until a busy receiver posts the receive.
"""

import pickle
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from llama.distributed import parallel

OPS_TAG = 7  # step messages: their own tag, so they never match a stage's hidden states or logits


def slot_groups(max_batch_size: int, stages: int) -> List[range]:
    """One consecutive range of cache slots per group: min(stages, slots) groups, sizes within one of each other."""
    n = min(stages, max_batch_size)
    bounds = [max_batch_size * k // n for k in range(n + 1)]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


class Link:
    """Rank 0's step messages (pickled objects) to the other ranks of the job, point to point."""

    def __init__(self, device, outbox):
        self.device, self.outbox = device, outbox
        self.everyone = list(range(1, dist.get_world_size()))
        self.first_stage = list(range(1, parallel.model_parallel_size()))  # rank = stage x T + tensor-parallel rank

    def post(self, msg: dict, ranks: List[int]) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        for rank in ranks:
            for t in (size, data):
                self.outbox.keep(dist.isend(t, rank, tag=OPS_TAG), t)

    def receive(self) -> dict:
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(size, 0, tag=OPS_TAG)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.recv(data, 0, tag=OPS_TAG)
        return pickle.loads(data.cpu().numpy().tobytes())


class Pipelined:
    """Rank 0's side: the groups, and their steps in flight (launched in turn, finished oldest first)."""

    def __init__(self, core, prefill_chunk: int, stages: int, outbox):
        self.core = core
        self.groups = [core.scheduler(prefill_chunk, r) for r in slot_groups(core.max_batch_size, stages)]
        self.outbox = outbox  # the stage model's sends (pipeline.Outbox)
        self.link = Link(core.runner.device, self.outbox)
        self.inflight: Deque[Tuple[object, object, Optional[list], int]] = deque()
        self.ticket = 0
        # overlapped: steps launched while another group's step was in flight (the first stage ran this one
        # while the later stages ran that one); trace: the first launch/finish events, for tests
        self.stats = {"launched": 0, "overlapped": 0, "max_in_flight": 0, "peak_active": 0}
        self.trace: List[Tuple[str, int, int]] = []

    def start(self) -> dict:
        """The message (sent over the engine's broadcast) that moves the other ranks onto this point-to-point
        protocol until stop()."""
        return {"pipelined": len(self.groups)}

    def assign(self, requests) -> None:
        """Queue new requests on the least loaded group (the samples of one prompt together: they share a
        prefill)."""
        placed: Dict[int, object] = {}
        for r in requests:
            g = placed.get(id(r.twin))
            if g is None:
                g = min(self.groups, key=lambda s: len(s.running()) + len(s.waiting))
            placed[id(r)] = g
            g.add([r])

    def has_work(self) -> bool:
        return bool(self.inflight) or any(g.has_work() for g in self.groups)

    def turn(self) -> None:
        """Launch every idle group that has work (up to one step per group in flight), then finish the oldest. When
        no group runs anything and none could admit its next request, those requests can never fit beside the live
        prefixes that hold the shared pool: they fail as the decode core's do (DecodeCore._unfit)."""
        flying = [g for g, *_ in self.inflight]
        for g in self.groups:
            if g.has_work() and not any(g is f for f in flying):
                self._launch(g)
        if self.inflight:
            self._finish()
        elif not any(g.running() for g in self.groups):
            for g in self.groups:
                if g.waiting:
                    self.core._unfit(g)

    def _launch(self, sched) -> None:
        self.ticket += 1
        t = self.outbox.ticket = self.ticket
        self.outbox.settle(t - len(self.groups))  # steps <= t - groups are finished: their sends have arrived
        plan, outs = self.core.launch(sched, lambda ops: self.link.post({"launch": ops, "ticket": t},
                                                                       self.link.everyone))
        if not plan.ops:  # nothing to run (requests that cannot be admitted yet): nothing to wait for
            self.core.finish(sched, plan, outs, publish=True)
            return
        s = self.stats
        s["launched"] += 1
        s["overlapped"] += bool(self.inflight)
        self.inflight.append((sched, plan, outs, t))
        s["max_in_flight"] = max(s["max_in_flight"], len(self.inflight))
        s["peak_active"] = max(s["peak_active"], sum(len(g.running()) for g in self.groups))
        self._record("launch", sched, t)

    def _finish(self) -> None:
        sched, plan, outs, t = self.inflight.popleft()
        if outs is not None and self.link.first_stage:
            self.link.post({"finish": t}, self.link.first_stage)
        self._record("finish", sched, t)
        self.core.finish(sched, plan, outs, publish=True)

    def _record(self, event: str, sched, ticket: int) -> None:
        if len(self.trace) < 256:
            self.trace.append((event, next(i for i, g in enumerate(self.groups) if g is sched), ticket))

    def beat(self) -> None:
        """An empty message while idle, so the other ranks' receive never reaches the process group's timeout."""
        self.link.post({"beat": True}, self.link.everyone)

    def stop(self, states: dict) -> None:
        """Release the other ranks (with rank 0's RNG states) and wait for every send."""
        self.link.post({"stop": states}, self.link.everyone)
        self.outbox.settle()


def follow(runner, execution, depth: int) -> dict:
    """The other ranks' side, until rank 0 stops: run each launched step's ops in order (on the first stage, keep
    their Pending logits until the step's finish message, then wait for them as rank 0 does). Returns the stop
    message's RNG states. execution: the runner's PipelineExecution."""
    outbox = execution.outbox
    link = Link(runner.device, outbox)
    first = execution.stage.first
    pending: Dict[int, list] = {}
    with execution.leader_samples(deferred=True):
        while True:
            msg = link.receive()
            if "launch" in msg:
                t = outbox.ticket = msg["ticket"]
                outbox.settle(t - depth)
                outs = runner.execute(msg["launch"])
                if first:
                    pending[t] = outs
            elif "finish" in msg:
                execution.resolve(pending.pop(msg["finish"]))
            elif "stop" in msg:
                outbox.settle()
                return msg["stop"]
