"""The runner: turns a step's plan into forward passes and cache copies, then samples and advances every request
that got logits. It holds the only calls of the model's forward pass that decode, and the compile policy: a
one-token step runs through the compiled decode graph when it is ready (llama/compilation/compiled_decode.py), else eagerly.

How the passes run across ranks is the Execution it is built with: the default is one stage (a single process,
or tensor-parallel ranks that all get the logits and sample alike). Pipeline stages bring their own (built by the
facade), so the core never imports them.
"""

import math
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from llama.compilation.compiled_decode import CompiledDecode, bucket
from llama.core.worker.kv_cache import KVCache
from llama.core.worker import ahead
from llama.core.speculation import speculative
from llama.core.scheduling.plan import CopyBlocks, CopyRows, Decode, LoadPrefix, Op, Plan, Prefill, SetBlocks, Verify
from llama.core.frontend.request import Request
from llama.sample.sampling import RowSampler, index, prompt_top_entries, token_logprobs


class Execution:
    """One stage: every forward pass returns its logits on this rank, and this rank samples them itself.

    The methods are what another layout (pipeline stages) changes: where a pass's logits go, how the sampled
    tokens reach every rank, and, for the engine, which ranks replay its steps and whether steps overlap.
    lockstep: (process group, source rank) over which the engine's leader broadcasts each step's ops to the
    ranks that replay them (tensor parallel), or None when this process runs alone.
    """

    def __init__(self, lockstep: Optional[Tuple[object, int]] = None):
        self.lockstep = lockstep

    def route(self, sampling: bool) -> Dict[str, object]:
        """Extra keyword arguments of a forward pass: sampling passes' logits are read only by sampling."""
        return {}

    def share(self, draw: Callable[[], tuple]) -> tuple:
        """draw() (tokens, log-probabilities, alternatives, failures): here, this rank draws its own."""
        return draw()

    def resolve(self, outs: List) -> List:
        """Ops' outputs, with any that are still on their way waited for, in order."""
        return outs

    @contextmanager
    def leader_samples(self, deferred: bool = False) -> Iterator[None]:
        """While the engine serves, its leader samples every request (deferred: it launches a step's passes
        before an earlier step's logits are back)."""
        yield

    def overlap(self, core, prefill_chunk: int):
        """The engine leader's overlapping groups of slots, or None: one step at a time."""
        return None

    def follow(self, runner: "Runner", depth: int) -> dict:
        """A follower's side of overlap(): replay the leader's steps until it stops; its stop message."""
        raise RuntimeError("this layout has no overlapping engine steps to follow")


def _name(proc) -> str:
    return getattr(proc, "__qualname__", None) or type(proc).__name__


def _unsampleable(r: Request, peak: float) -> str:
    procs = r.params.logits_processors
    after = f" after logits processor(s) {', '.join(map(_name, procs))}" if procs else ""
    return (f"request {r.id}: its next-token logits{after} are all -inf or contain NaN or +inf (max {peak}), so "
            "no token can be sampled")


class Runner:
    def __init__(self, model, cache: KVCache, compiled: Optional[CompiledDecode] = None,
                 execution: Optional[Execution] = None):
        self.model, self.cache, self.compiled = model, cache, compiled
        self.execution = Execution() if execution is None else execution
        self.device = cache.device
        self._sampler: Optional[Tuple[List[Request], RowSampler]] = None
        # queue decode steps ahead (llama/core/worker/ahead.py) in one stage: a single process, or tensor-parallel ranks
        # that each draw the same tokens and queue the same step; not while the engine's followers replay ops
        self.run_ahead = ahead.enabled(self.device, type(self.execution) is Execution)
        self._replaying = False
        self._queued: Optional[ahead.Queued] = None
        self.ahead_stats = {"queued": 0, "used": 0}
        self._ops = {LoadPrefix: self._load, CopyRows: self._copy, Prefill: self._prefill, Decode: self._decode,
                     Verify: self._verify,
                     SetBlocks: lambda op: self.cache.set_blocks(op.rows, op.blocks),
                     CopyBlocks: lambda op: self.cache.copy_blocks(op.src, op.dst)}

    @contextmanager
    def leader_samples(self, deferred: bool = False) -> Iterator[None]:
        """While the engine serves: its leader samples every request (see Execution.leader_samples), and ranks
        that replay its ops have no queued step to use, so it queues none."""
        replaying, self._replaying = self._replaying, self.execution.lockstep is not None
        try:
            with self.execution.leader_samples(deferred):
                yield
        finally:
            self._replaying = replaying

    def _sampling_pass(self, *args, **kwargs) -> torch.Tensor:
        """A forward pass whose logits only sampling reads (on pipeline stages they need not reach every rank)."""
        return self.model(*args, **kwargs, **self.execution.route(sampling=True))

    def _full_pass(self, *args, **kwargs) -> torch.Tensor:
        """A forward pass whose logits every rank reads."""
        return self.model(*args, **kwargs, **self.execution.route(sampling=False))

    # ------------------------------------------------------------------------------------------ forward passes
    @torch.inference_mode()  # also what lets Inductor freeze the weights into the compiled graph
    def execute(self, ops: List[Op]) -> List[Optional[torch.Tensor]]:
        queued, self._queued = self._queued, None
        with getattr(self.cache, "manage", nullcontext)():
            found = None if queued is None else queued.take(ops, self._decode_shape)
            if found is not None:  # the step queued ahead is this plan's Decode op
                self.ahead_stats["used"] += 1
                return [queued.logits if i == found else self._op(op) for i, op in enumerate(ops)]
            return [self._op(op) for op in ops]

    def _op(self, op: Op) -> Optional[torch.Tensor]:
        run = self._ops.get(type(op))
        if run is None:
            raise TypeError(f"unknown op {op!r}: expected one of {', '.join(c.__name__ for c in self._ops)}")
        return run(op)

    def _copy(self, op: CopyRows) -> None:
        self.cache.copy_rows(op.src, op.dst, op.length)

    def _load(self, op: LoadPrefix) -> None:
        self.cache.continue_prefix(self.cache.prefix(op.prefix).blocks, op.row, op.length)

    def _prefill(self, op: Prefill) -> torch.Tensor:
        dev = self.device
        start = op.start if isinstance(op.start, int) else torch.tensor(op.start, device=dev)
        rows = None if op.rows == list(range(len(op.rows))) else torch.tensor(op.rows, device=dev)
        last = None if op.last is None else torch.tensor(op.last, device=dev)
        forward = self._full_pass if last is None else self._sampling_pass
        return forward(torch.tensor(op.tokens, device=dev), start, rows=rows, logit_index=last, kv_len=op.kv_len)

    def _decode_shape(self, op: Decode) -> Tuple[bool, int, int]:
        """(compiled, rows, the graph's batch size) of the pass that runs a Decode op.

        Eager, the step spans slots 0..highest active. Compiled on CPU too, rounded up to its graph's batch size (a
        power of two, so a handful of graphs serve any mix of requests; each is subject to the memory check, as
        graphs of float weights hold their own copy): there each row costs its products, and one request in a cache
        of 8 rows must not pay for 8. Compiled on CUDA, the step spans every slot: a GPU decodes a few rows in the
        time of one, and one graph (one compile, one CUDA graph) serves every step."""
        c, width, size = self.compiled, max(op.active) + 1, len(op.tokens)
        if not getattr(c, "cuda", False):
            size = min(bucket(width, self.model.max_batch_size), size)
        if c is not None and not op.base and self.cache.dtype != torch.int8 and c.ready(c.key(size, None)):
            return True, size, size
        return False, width, size

    def _decode(self, op: Decode, tokens: Optional[torch.Tensor] = None,
                shape: Optional[Tuple[bool, int, int]] = None) -> torch.Tensor:
        """Logits (rows, V) of one token per slot, rows indexed by slot (slot s in cache row base + s). tokens: the
        op's tokens already on the device (a step queued ahead feeds the drawn ones). Under compile="auto" an eager
        step's time counts toward compiling the graph of its size."""
        dev, c = self.device, self.compiled
        compiled, n, size = self._decode_shape(op) if shape is None else shape
        tokens = index(op.tokens[:n], dev) if tokens is None else tokens[:n]
        if compiled:
            return c(tokens[:, None], index(op.pos[:n], dev))[:, 0]
        same = len(set(op.pos[:n])) == 1
        start = time.perf_counter()
        rows = {"rows": slice(op.base, op.base + n)} if op.base else {}  # an engine group's slots: rows in place
        logits = self._sampling_pass(tokens[:, None], op.pos[0] if same else index(op.pos[:n], dev), **rows)[:, 0]
        if c is not None and c.lazy:
            c.spent_eager(size, None, time.perf_counter() - start)
        return logits

    def _verify(self, op: Verify) -> torch.Tensor:
        """Logits (rows, V) of a Verify op: through the compiled step where one-token steps are compiled (every
        batch size, compile=True: not compile="auto", whose eager-to-compiled switch is timed), else eagerly; so
        each row's arithmetic is the one-token step's (llama/core/speculation/speculative.py)."""
        c, dev = self.compiled, self.device
        if c is not None and not c.lazy and self.cache.dtype != torch.int8:
            logits = c(index(op.tokens, dev)[:, None], index(op.pos, dev), index(op.rows, dev),
                       cap=speculative.MAX_ROWS)
            if logits is not None:
                return logits[:, 0]
        return speculative.verify(self._sampling_pass, op, dev)

    def compiles(self) -> int:
        """Decode graphs compiled (or loaded) so far: a step that made one took its compile's time too."""
        return 0 if self.compiled is None else len(self.compiled.seen)

    @torch.inference_mode()
    def logits(self, batch: List[List[int]]) -> torch.Tensor:
        """Every position's logits (B, T, V) of token lists placed in slots 0..B-1 from position 0 (scoring and
        prefixes; right-padded, so only each list's own positions mean anything)."""
        width = max(map(len, batch))
        self._queued = None  # a step queued ahead is never the next plan's after this
        with self.cache.manage(), self.cache.borrow(len(batch), width):
            return self._full_pass(torch.tensor([s + [0] * (width - len(s)) for s in batch], device=self.device), 0)

    # ------------------------------------------------------------------------------------------ one step
    def run(self, plan: Plan) -> List[Tuple[Request, str]]:
        """Execute a plan; sample and advance each request that has logits now. Returns (request, text delta)
        for new text. A request that fails is marked (finish_reason "error") and the others go on."""
        return self.complete(plan, self.execute(plan.ops))

    def complete(self, plan: Plan, outs: List, ahead_ok: bool = False) -> List[Tuple[Request, str]]:
        """The second half of run(): wait for deferred logits (in op order, as the pipeline's other first-stage
        ranks do), then sample and advance. ahead_ok: the caller's next plan is likely this step's continuation
        (no one waits for a free slot), so queueing it ahead may pay (llama/core/worker/ahead.py)."""
        outs = self.execution.resolve(outs)
        if ahead_ok and self.run_ahead and not self._replaying and ahead.eligible(plan):
            return self._complete_ahead(plan, outs)
        ready: List[Tuple[Request, torch.Tensor]] = []
        jobs = iter(plan.prefill)
        for op, out in zip(plan.ops, outs):
            if not isinstance(op, Prefill):
                continue
            for i in range(len(op.rows)):
                r, s, c = next(jobs)
                if r.generated:  # a preempted request's recompute (llama/core/scheduling/paging.py): its tokens are known
                    continue
                if op.last is None:  # every position's logits: some request echoes its prompt's scores
                    if r.params.scores_prompt:
                        end = min(s + c + 1, len(r.prompt))
                        r.prompt_logprobs = r.prompt_logprobs + token_logprobs(out[i, :c], r.prompt[s:end])
                        if r.params.top_logprobs:
                            r.prompt_top_logprobs = r.prompt_top_logprobs + prompt_top_entries(
                                out[i, :c], r.prompt[s:end], r.params.top_logprobs)
                    logits = out[i, c - 1]
                else:
                    logits = out[i, 0]
                if s + c == len(r.prompt):
                    ready.append((r, logits))
                    if r.has_twins:
                        r.first_logits = logits.clone()
        for r, src in plan.twins:
            r.prompt_logprobs, r.reused = list(src.prompt_logprobs), src.reused
            r.prompt_top_logprobs = list(src.prompt_top_logprobs)
            ready.append((r, src.first_logits))
        if plan.decoding:
            out = next(o for op, o in zip(plan.ops, outs) if isinstance(op, Decode))
            ready += [(r, out[r.slot]) for r in plan.decoding]
        if plan.verifying:  # each draft's first position samples with the rest; the others follow, in order
            checked = next(o for op, o in zip(plan.ops, outs) if isinstance(op, Verify))
            return speculative.accept(self.sample, plan, checked, ready)
        return self.sample(ready) if ready else []

    def sample(self, ready: List[Tuple[Request, torch.Tensor]]) -> List[Tuple[Request, str]]:
        reqs = [r for r, _ in ready]
        tokens, lps, tops, failed = self.execution.share(lambda: self._draw(ready))
        for b, message in failed.items():  # drawn on another rank (a pipeline's last stage): fail them here too
            if reqs[b].error is None:
                reqs[b].fail(ValueError(message))
        deltas = []
        for b, r in enumerate(reqs):
            if b not in failed:
                text = r.advance(tokens[b], lps[b] if lps is not None else None, tops[b] if tops is not None else None)
                if text:
                    deltas.append((r, text))
        return deltas

    def _complete_ahead(self, plan: Plan, outs: List) -> List[Tuple[Request, str]]:
        """complete() of a decode-only step, drawn on the device: queue the next step with the drawn tokens, then
        copy them to the host and advance the requests while that step runs. Same draws as sample()."""
        i = next(k for k, op in enumerate(plan.ops) if isinstance(op, Decode))
        op, reqs = plan.ops[i], plan.decoding
        logits = torch.stack([outs[i][r.slot] for r in reqs])
        peak = logits.amax(dim=-1)
        logits.masked_fill_(~torch.isfinite(peak)[:, None], 0.0)  # failing rows, as _draw: arithmetic stays finite
        tokens, lsm = self._row_sampler(reqs).draw(logits)
        lps = None if lsm is None else lsm.gather(1, tokens[:, None])[:, 0]
        (tokens_h, peak_h, lps_h), wait = ahead.to_host([tokens, peak, lps])
        nxt = ahead.next_step(op, reqs, self.cache.max_seq_len, self.cache.block_size)
        if nxt is not None:
            shape = self._decode_shape(nxt)
            # As in execute(): the step's inputs are inference tensors, or a compiled step's guards would fail and
            # compile a second graph, which may round differently.
            with torch.inference_mode(), self.cache.manage():
                fed = index(nxt.tokens, self.device)
                fed[index(op.active, self.device)] = tokens
                held = {nxt.base + r.slot: tuple(r.blocks) for r in reqs}
                self._queued = ahead.Queued(nxt, self._decode(nxt, fed, shape), shape, held)
            self.ahead_stats["queued"] += 1
        wait()
        drawn, peaks = tokens_h.tolist(), peak_h.tolist()
        lps_l = None if lps_h is None else lps_h.tolist()
        if self._queued is not None:
            for s, tok in zip(op.active, drawn):
                self._queued.op.tokens[s] = tok
        deltas = []
        for b, r in enumerate(reqs):
            if not math.isfinite(peaks[b]):
                r.fail(ValueError(_unsampleable(r, peaks[b])))
                continue
            text = r.advance(drawn[b], lps_l[b] if lps_l is not None else None, None)
            if text:
                deltas.append((r, text))
        return deltas

    def _row_sampler(self, reqs: List[Request]) -> RowSampler:
        last = self._sampler[0] if self._sampler is not None else []
        if len(last) != len(reqs) or any(a is not b for a, b in zip(last, reqs)):  # same rows: reuse the tensors
            self._sampler = (reqs, RowSampler(reqs, self.device))
        return self._sampler[1]

    def _draw(self, ready: List[Tuple[Request, torch.Tensor]]) -> Tuple[List[int], Optional[List[float]],
                                                                        Optional[List], Dict]:
        """(token per row, log-probabilities or None, top_logprobs alternatives or None, {row: error message} of the
        rows that failed)."""
        reqs = [r for r, _ in ready]
        logits = torch.stack([lg for _, lg in ready])
        ok = [self._process(b, r, logits) for b, r in enumerate(reqs)]
        peak = logits.amax(dim=-1)  # NaN anywhere -> NaN; all -inf -> -inf; any +inf -> +inf
        bad = (~torch.isfinite(peak)).tolist()
        for b, r in enumerate(reqs):
            if ok[b] and bad[b]:
                r.fail(ValueError(_unsampleable(r, float(peak[b]))))
                ok[b] = False
        if not all(ok):
            logits[torch.tensor([not k for k in ok])] = 0.0  # failed rows: keep the sampler's arithmetic finite
        tokens, lps, tops = self._row_sampler(reqs)(logits)
        return tokens, lps, tops, {b: str(r.error) for b, r in enumerate(reqs) if not ok[b]}

    def _process(self, b: int, r: Request, logits: torch.Tensor) -> bool:
        """Apply a request's logits processors, then its grammar's mask, to its row; on a broken one, fail the
        request (False)."""
        row = logits[b]
        for proc in r.params.logits_processors:
            try:
                out = proc(list(r.generated), row)
            except Exception as e:
                r.fail(ValueError(f"request {r.id}: logits processor {_name(proc)} raised {e!r}"))
                return False
            if not isinstance(out, torch.Tensor) or out.shape != row.shape:
                got = "None" if out is None else (f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
                                                  else type(out).__name__)
                r.fail(ValueError(f"request {r.id}: logits processor {_name(proc)} returned {got}; it must return "
                                  f"the logits, a tensor of shape {tuple(row.shape)}"))
                return False
            row = out
        if r.params.logits_processors:
            logits[b] = row
        if r.matcher is not None:
            try:
                r.matcher.mask(logits[b])
            except Exception as e:
                r.fail(ValueError(f"request {r.id}: {e}"))
                return False
        return True
