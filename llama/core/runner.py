"""The runner: turns a step's plan into forward passes and cache copies, then samples and advances every request
that got logits. It holds the only calls of the model's forward pass that decode, and the compile policy: a
one-token step runs through the compiled decode graph when it is ready (llama/compilation/compiled_decode.py), else eagerly.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from llama.compilation.compiled_decode import CompiledDecode, bucket
from llama.core.kv_cache import KVCache
from llama.core.request import Request
from llama.distributed.pipeline import Pending
from llama.sample.sampling import RowSampler, prompt_top_entries, token_logprobs


@dataclass
class Plan:
    """One step: `ops` in order (what model-parallel followers replay), and which requests they serve."""

    ops: List[Dict] = field(default_factory=list)
    prefill: List[Tuple[Request, int, int]] = field(default_factory=list)  # (request, start, length), in op order
    twins: List[Tuple[Request, Request]] = field(default_factory=list)  # (request, the source it copies)
    decoding: List[Request] = field(default_factory=list)


def resolve(outs: List) -> List:
    """Ops' outputs with every deferred one (a pipeline stage's Pending logits) waited for, in order."""
    return [o.result() if isinstance(o, Pending) else o for o in outs]


def _name(proc) -> str:
    return getattr(proc, "__qualname__", None) or type(proc).__name__


class Runner:
    def __init__(self, model, cache: KVCache, compiled: Optional[CompiledDecode] = None):
        self.model, self.cache, self.compiled = model, cache, compiled
        self.device = cache.device
        self._sampler: Optional[Tuple[List[Request], RowSampler]] = None
        # Pipeline stages (llama/distributed/pipeline.py): the last stage samples and shares the tokens, except under the
        # engine, whose rank 0 samples (leader_samples).
        self.staged = self.share_samples = callable(getattr(model, "share_samples", None))

    @contextmanager
    def leader_samples(self, deferred: bool = False):
        """While the engine serves: its leader samples every request, so the last pipeline stage sends the logits to
        the first stage, where the leader is. deferred (the pipelined engine): the first stage's sampling passes
        return a Pending that complete() waits on, so a step's passes can be launched before the last one's
        logits are back."""
        shared, self.share_samples = self.share_samples, False
        if self.staged:
            self.model.deferred = deferred
        try:
            yield
        finally:
            self.share_samples = shared
            if self.staged:
                self.model.deferred = False

    def _sampling_pass(self, *args, **kwargs) -> torch.Tensor:
        """A forward pass whose logits only sampling reads: on pipeline stages they stay on the last stage (shared
        samples) or go to the first (the engine's leader samples)."""
        if not self.staged:
            return self.model(*args, **kwargs)
        self.model.logits_to = "last" if self.share_samples else "first"
        try:
            return self.model(*args, **kwargs)
        finally:
            self.model.logits_to = "all"

    # ------------------------------------------------------------------------------------------ forward passes
    @torch.inference_mode()  # also what lets Inductor freeze the weights into the compiled graph
    def execute(self, ops: List[Dict]) -> List[Optional[torch.Tensor]]:
        return [self._op(op) for op in ops]

    def _op(self, op: Dict) -> Optional[torch.Tensor]:
        kind = op["kind"]
        if kind == "copy":
            self.cache.copy_rows(op["src"], op["dst"], op["length"])
        elif kind == "load":
            self.cache.load(self.cache.prefix(op["prefix"]).kv, op["slot"], op["length"])
        elif kind == "prefill":
            dev = self.device
            start = op["start"] if isinstance(op["start"], int) else torch.tensor(op["start"], device=dev)
            slots = None if op["slots"] == list(range(len(op["slots"]))) else torch.tensor(op["slots"], device=dev)
            last = None if op["last"] is None else torch.tensor(op["last"], device=dev)
            forward = self.model if last is None else self._sampling_pass
            return forward(torch.tensor(op["tokens"], device=dev), start, rows=slots, logit_index=last,
                           kv_len=op["kv_len"])
        elif kind == "decode":
            return self._decode(op["tokens"], op["pos"], op["slots"], op.get("base", 0))
        else:
            raise ValueError(f"unknown op {kind!r}")
        return None

    def _decode(self, tokens: List[int], pos: List[int], active: List[int], base: int = 0) -> torch.Tensor:
        """Logits (rows, V) of one token per slot, rows indexed by slot (slot s in cache row base + s).

        Eager, the step spans slots 0..highest active. Compiled on CPU too, rounded up to its graph's batch size (a
        power of two, so a handful of graphs serve any mix of requests; each is subject to the memory check, as
        graphs of float weights hold their own copy): there each row costs its products, and one request in a
        cache of 8 rows must not pay for 8. Compiled on CUDA, the step spans every slot: a GPU decodes a few rows in
        the time of one, and one graph (one compile, one CUDA graph) serves every step. Under compile="auto" an
        eager step's time counts toward compiling the graph of its size.
        """
        dev, c = self.device, self.compiled
        width = max(active) + 1
        size = len(tokens)  # the graph's batch: slots 0..size-1
        if not getattr(c, "cuda", False):
            size = min(bucket(width, self.model.max_batch_size), size)
        if c is not None and not base and c.ready(c.key(size, None)):
            return c(torch.tensor(tokens[:size], device=dev)[:, None], torch.tensor(pos[:size], device=dev))[:, 0]
        x = torch.tensor(tokens[:width], device=dev)[:, None]
        same = len(set(pos[:width])) == 1
        start = time.perf_counter()
        rows = {"rows": slice(base, base + width)} if base else {}  # an engine group's slots: rows in place
        logits = self._sampling_pass(x, pos[0] if same else torch.tensor(pos[:width], device=dev), **rows)[:, 0]
        if c is not None and c.lazy:
            c.spent_eager(size, None, time.perf_counter() - start)
        return logits

    @torch.inference_mode()
    def logits(self, batch: List[List[int]]) -> torch.Tensor:
        """Every position's logits (B, T, V) of token lists placed in slots 0..B-1 from position 0 (scoring and
        prefixes; right-padded, so only each list's own positions mean anything)."""
        width = max(map(len, batch))
        return self.model(torch.tensor([s + [0] * (width - len(s)) for s in batch], device=self.device), 0)

    # ------------------------------------------------------------------------------------------ one step
    def run(self, plan: Plan) -> List[Tuple[Request, str]]:
        """Execute a plan; sample and advance each request that has logits now. Returns (request, text delta)
        for new text. A request that fails is marked (finish_reason "error") and the others go on."""
        return self.complete(plan, self.execute(plan.ops))

    def complete(self, plan: Plan, outs: List) -> List[Tuple[Request, str]]:
        """The second half of run(): wait for deferred logits (in op order, as the pipeline's other first-stage
        ranks do), then sample and advance."""
        outs = resolve(outs)
        ready: List[Tuple[Request, torch.Tensor]] = []
        jobs = iter(plan.prefill)
        for op, out in zip(plan.ops, outs):
            if op["kind"] != "prefill":
                continue
            for i in range(len(op["slots"])):
                r, s, c = next(jobs)
                if op["last"] is None:  # every position's logits: some request echoes its prompt's scores
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
            out = outs[-1]
            ready += [(r, out[r.slot]) for r in plan.decoding]
        return self.sample(ready) if ready else []

    def sample(self, ready: List[Tuple[Request, torch.Tensor]]) -> List[Tuple[Request, str]]:
        reqs = [r for r, _ in ready]
        if self.share_samples:  # drawn on the last pipeline stage, the same tokens and failures on every rank
            tokens, lps, tops, failed = self.model.share_samples(lambda: self._draw(ready))
            for b, message in failed.items():
                if reqs[b].error is None:
                    reqs[b].fail(ValueError(message))
        else:
            tokens, lps, tops, failed = self._draw(ready)
        deltas = []
        for b, r in enumerate(reqs):
            if b not in failed:
                text = r.advance(tokens[b], lps[b] if lps is not None else None, tops[b] if tops is not None else None)
                if text:
                    deltas.append((r, text))
        return deltas

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
                procs = r.params.logits_processors
                after = f" after logits processor(s) {', '.join(map(_name, procs))}" if procs else ""
                r.fail(ValueError(f"request {r.id}: its next-token logits{after} are all -inf or contain NaN or "
                                  f"+inf (max {float(peak[b])}), so no token can be sampled"))
                ok[b] = False
        if not all(ok):
            logits[torch.tensor([not k for k in ok])] = 0.0  # failed rows: keep the sampler's arithmetic finite
        last = self._sampler[0] if self._sampler is not None else []
        if len(last) != len(reqs) or any(a is not b for a, b in zip(last, reqs)):  # same rows: reuse the tensors
            self._sampler = (reqs, RowSampler(reqs, self.device))
        tokens, lps, tops = self._sampler[1](logits)
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
