"""Continuous batching: max_batch_size KV-cache slots, a queue of requests, one scheduling step at a time.

Every step admits waiting requests into free slots, prefills their prompts in chunks of at most `prefill_chunk`
tokens (so one long prompt does not stall everyone else), decodes one token for every decoding slot in a single
forward pass with per-row positions, and retires finished requests at once, freeing their slots. Rows, text
streams and seeded draws are the ones `Llama` uses, so a request gives the same text as when it runs alone.

Cache ownership: the engine holds `Llama.lock` around every step and, when it runs in its background thread, from
the moment it has work until it is idle again. Other calls on the same Llama (text_completion, prefill, score,
chat sessions) therefore wait until the engine is idle; they can never overwrite the slots of running requests.

Model parallel (world size > 1): rank 0 (of each model-parallel group) owns the queue, schedules every step and
broadcasts the step's forward passes; the other ranks call `serve_forever()`, which replays them until rank 0
calls `close()`. Sampling and text happen on rank 0 only; its RNG state is broadcast on close so later calls
agree across ranks. Offline use (`Llama._complete`) runs the same deterministic schedule on every rank instead.
"""

import itertools
import threading
import time
from collections import deque
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .sampling import RowSampler, token_logprobs
from .sequence import Row
from .handle import Handle
from .chat import UNSAFE_ERROR, has_special_tags, validate_dialog

@dataclass
class _Request:
    row: Row
    handle: Optional[Handle] = None
    slot: int = -1
    order: int = 0  # admission order: older requests get the prefill budget first
    prefilled: int = 0  # prompt positions whose keys/values are in the slot
    feed: Optional[int] = None  # sampled token to feed at the next decode step
    feed_pos: int = 0

    @property
    def cancelled(self) -> bool:
        return self.handle is not None and self.handle._cancel


class Engine:
    """Continuous batching over one Llama's KV cache. See the module docstring for the threading model."""

    HEARTBEAT = 60.0  # seconds between empty steps an idle model-parallel rank 0 sends (gloo/nccl time out)

    def __init__(self, llama, prefill_chunk: int = 128, *, mode: str = "auto"):
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        if mode not in ("auto", "local"):
            raise ValueError(f"mode must be 'auto' or 'local', got {mode!r}")
        self.llama = llama
        self.model = llama.model
        self.device = llama.device
        self.prefill_chunk = prefill_chunk
        self.slots: List[Optional[_Request]] = [None] * llama.max_batch_size
        self.stats = {"steps": 0, "forwards": 0, "admitted": 0, "finished": 0, "generated_tokens": 0,
                      "prefill_tokens": 0, "peak_active": 0, "moves": 0}
        self._waiting: deque = deque()
        self._incoming: deque = deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._released = threading.Event()  # set once close() is done; ends serve_forever on rank 0
        self._ids = itertools.count()
        self._order = itertools.count()
        self._offline = False
        self._role, self._group, self._src = "single", None, 0
        if mode == "auto" and dist.is_initialized():
            from fairscale.nn.model_parallel import initialize as fs_init

            if fs_init.model_parallel_is_initialized() and fs_init.get_model_parallel_world_size() > 1:
                self._group, self._src = fs_init.get_model_parallel_group(), fs_init.get_model_parallel_src_rank()
                self._role = "leader" if fs_init.get_model_parallel_rank() == 0 else "follower"
        if self._role == "leader":  # its idle heartbeats keep the other ranks' broadcast from timing out
            self._thread = threading.Thread(target=self._loop, name="llama-engine", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------------------------------------ online
    def submit(self, prompt, *, prefix=None, **params) -> Handle:
        """Queue a prompt (str or token ids) or a dialog (list of messages) with SamplingParams keywords.

        prefix: a Llama.prefill() Prefix that a text or token prompt continues (its cache is copied, not recomputed).

        Never raises for a bad request: a prompt that cannot fit or bad parameters make result() raise, and the
        engine keeps serving the others.
        """
        if self._role == "follower":
            raise RuntimeError(
                f"only model-parallel rank 0 accepts requests; this is rank {dist.get_rank()}: call "
                "engine.serve_forever() here instead"
            )
        chat = isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt)
        handle = Handle(self, next(self._ids), chat)
        try:
            row = self._make_row(prompt, params, chat, prefix)
        except (ValueError, TypeError) as e:
            handle._settle(None, e, "error")
            return handle
        if row is None:  # a dialog with the template's special tags: the reference's error text is the answer
            lp = params.get("logprobs", False)
            handle._put(UNSAFE_ERROR)
            pred = {"generation": {"role": "assistant", "content": UNSAFE_ERROR},
                    **({"tokens": [], "logprobs": []} if lp else {})}
            handle._settle(pred, None, "error")
            return handle
        with self._cv:
            if self._closed:
                handle._settle(None, RuntimeError("the engine is closed: create a new one with Llama.engine()"),
                               "error")
                return handle
            self._incoming.append(_Request(row, handle))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="llama-engine", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return handle

    def close(self, cancel: bool = False) -> None:
        """Stop accepting requests, finish (or with cancel=True, cancel) the queued ones and stop the thread.

        Under model parallel this also releases the other ranks from serve_forever().
        """
        with self._cv:
            self._closed = True
            if cancel:
                for r in list(self._incoming) + list(self._waiting) + [r for r in self.slots if r is not None]:
                    if r.handle is not None:
                        r.handle._cancel = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self._role == "leader" and not self._released.is_set():
            states = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available():
                states["cuda"] = torch.cuda.get_rng_state()
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
            if "stop" in msg:
                torch.set_rng_state(msg["stop"]["cpu"])
                if "cuda" in msg["stop"] and torch.cuda.is_available():
                    torch.cuda.set_rng_state(msg["stop"]["cuda"])
                return
            with self.llama.lock:
                for op in msg["ops"]:
                    self._forward(op)

    # ------------------------------------------------------------------------------------------------ offline
    def complete(self, rows: List[Row], longest_first: bool = True) -> List[Row]:
        """Run rows to completion in the calling thread (Llama._complete); rows are filled in place.

        With the whole workload known, rows are admitted longest max_new first (longest-processing-time
        scheduling): a long request then never starts last and keeps one slot busy alone at the end.
        Seeded sampling makes the order invisible in the results.
        """
        with self._cv:
            if self._thread is not None:
                raise RuntimeError("complete() cannot run while the engine's thread serves submitted requests")
        self._offline = True
        order = sorted(rows, key=lambda r: -r.max_new) if longest_first else rows
        self._waiting.extend(_Request(r) for r in order)
        with self.llama.lock:
            while self._step():
                pass
        return rows

    # ------------------------------------------------------------------------------------------------ internals
    def _make_row(self, prompt, params: Dict, chat: bool, prefix=None) -> Optional[Row]:
        llama = self.llama
        if chat and prefix is not None:
            raise ValueError("prefix applies to text or token prompts, not dialogs: use Llama.chat_session()")
        if chat:
            validate_dialog(prompt)
            if has_special_tags(prompt):
                llama._params(1, **params)  # still report bad parameters
                return None
            tokens = llama.formatter.encode_dialog_prompt(prompt)
        elif isinstance(prompt, str):
            tokens = llama._with_prefix(prefix, llama.tokenizer.encode(prompt, bos=prefix is None, eos=False))
        elif isinstance(prompt, (list, tuple)):
            tokens = llama._with_prefix(prefix, llama._check_tokens("prompt", prompt))
        else:
            raise ValueError(f"expected a str, a list of token ids or a dialog, got {type(prompt).__name__}")
        if not tokens:
            raise ValueError("the prompt is empty; it needs at least one token")
        if len(tokens) >= llama.max_seq_len:
            raise ValueError(
                f"the prompt has {len(tokens)} tokens; it must be shorter than "
                f"max_seq_len={llama.max_seq_len} (shorten it or build the generator with a larger max_seq_len)"
            )
        return llama._rows([tokens], llama._params(1, **params), prefix=prefix, chat=chat)[0]

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _has_work(self) -> bool:
        with self._cv:
            return self._work_locked()

    def _work_locked(self) -> bool:
        return bool(self._incoming or self._waiting or any(r is not None for r in self.slots))

    def _loop(self) -> None:
        """The background thread: own the cache while there is work, exit when idle.

        Under model parallel it stays until close(), sending an empty step every HEARTBEAT seconds while idle
        so the other ranks' waiting broadcast never reaches the process group's timeout.
        """
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
                self._broadcast({"ops": []})
                continue
            with self.llama.lock:
                while True:
                    try:
                        if not self._step():
                            break
                    except Exception as e:  # the cache state is unknown: fail the running requests only
                        for s, r in enumerate(self.slots):
                            if r is not None:
                                self.slots[s] = None
                                self._settle(r, RuntimeError(f"request {r.handle.id} failed: {e!r}"), "error")

    def _broadcast(self, obj):
        objs = [obj]
        dist.broadcast_object_list(objs, src=self._src, group=self._group)
        return objs[0]

    def _step(self) -> bool:
        """One scheduling step; returns whether work remains."""
        with self.llama.lock:
            self._intake()
            self._admit()
            ops = self._compact()
            jobs = self._plan_prefill()
            decoding = [r for r in self.slots if r is not None and r.feed is not None]
            ops += self._prefill_ops(jobs)
            if decoding:
                ops.append(self._decode_op(decoding))
            if ops:
                if self._role == "leader":
                    self._broadcast({"ops": ops})
                outs = [self._forward(op) for op in ops]
                ready = self._prefill_results(jobs, ops, outs)
                if decoding:
                    logits = outs[-1]
                    ready += [(r, logits[r.slot]) for r in decoding]
                if ready:  # none when every forward was a prefill chunk that does not end a prompt
                    self._advance(ready)
                self.stats["steps"] += 1
                self.stats["forwards"] += sum(op["kind"] != "copy" for op in ops)
            return self._has_work()

    def _intake(self) -> None:
        with self._cv:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            self._settle(r, CancelledError(f"request {r.handle.id} was cancelled"), "cancelled")
        for s, r in enumerate(self.slots):
            if r is not None and r.cancelled:
                self.slots[s] = None
                self._settle(r, CancelledError(f"request {r.handle.id} was cancelled"), "cancelled")

    def _admit(self) -> None:
        for s in range(len(self.slots)):
            if not self._waiting:
                break
            if self.slots[s] is None:
                r = self._waiting.popleft()
                r.slot, r.order = s, next(self._order)
                row = r.row
                if row.prefix is not None:  # offline prompts continuing a Llama.prefill() prefix
                    row.reused = row.prefix.load_into(self.model, s, row.prompt)
                    r.prefilled = row.reused
                    if row.params.echo and row.params.logprobs:
                        row.prompt_logprobs = row.prefix.prompt_logprobs(row.prompt, row.reused)
                self.slots[s] = r
                self.stats["admitted"] += 1
        active = sum(r is not None for r in self.slots)
        self.stats["peak_active"] = max(self.stats["peak_active"], active)

    def _compact(self) -> List[Dict]:
        """With no one waiting, move requests from the highest slots into free lower ones.

        The decode forward runs over slots 0..B-1 (B = highest busy slot + 1) so it can read the cache without
        copying it; a gap below a busy slot costs a dummy row every step. Moving a request copies its cached
        positions once.
        """
        if self._waiting:
            return []
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
            length = max(length, r.feed_pos if r.feed is not None else r.prefilled)
        if not src or length == 0:
            return []
        self.stats["moves"] += len(src)
        return [{"kind": "copy", "src": src, "dst": dst, "length": length}]

    def _plan_prefill(self) -> List:
        """(request, start, length) chunks for this step, oldest requests first, prefill_chunk tokens in all."""
        budget, jobs = self.prefill_chunk, []
        for r in sorted((r for r in self.slots if r is not None), key=lambda r: r.order):
            n = len(r.row.prompt) - r.prefilled
            if n > 0 and budget > 0:
                c = min(n, budget)
                jobs.append((r, r.prefilled, c))
                r.prefilled += c
                budget -= c
        return jobs

    def _prefill_ops(self, jobs: List) -> List[Dict]:
        """Padded (rows, width) forwards; a group's padding never reaches past max_seq_len."""
        groups: List[List] = []
        for job in jobs:
            g = groups[-1] if groups else None
            if g is not None and max(s for _, s, _ in g + [job]) + max(c for _, _, c in g + [job]) <= self.llama.max_seq_len:
                g.append(job)
            else:
                groups.append([job])
        ops = []
        for g in groups:
            width = max(c for _, _, c in g)
            starts = [s for _, s, _ in g]
            full = any(r.row.params.echo and r.row.params.logprobs for r, _, _ in g)
            ops.append({
                "kind": "prefill",
                "tokens": [r.row.prompt[s : s + c] + [0] * (width - c) for r, s, c in g],
                "start": starts[0] if len(set(starts)) == 1 else starts,
                "slots": [r.slot for r, _, _ in g],
                "last": None if full else [c - 1 for _, _, c in g],
                "kv_len": max(starts) + width,
            })
            self.stats["prefill_tokens"] += sum(c for _, _, c in g)
        return ops

    def _decode_op(self, decoding: List[_Request]) -> Dict:
        """One token for every decoding slot, over slots 0..B-1 with no cache gather (rows=None).

        Slots in the range that are not decoding get a dummy token at a position no one has filled yet (their
        next prefill position, or 0 for a free slot), which is always rewritten before it is read. With a compiled
        decode step (llama.compile) every step spans all slots, so one graph serves them all, and kv_len is left
        unset since that is what selects the compiled path. While compile="auto" still decodes eagerly, steps
        span only the slots in use (see _forward).
        """
        step = getattr(self.model, "compiled_step", None)
        compiled = step is not None and step.ready(step.key(len(self.slots), None))
        width = len(self.slots) if compiled else max(r.slot for r in decoding) + 1
        tokens, pos = [0] * width, [0] * width
        for s in range(width):
            r = self.slots[s]
            if r is None:
                continue
            if r.feed is not None:
                tokens[s], pos[s] = r.feed, r.feed_pos
            else:
                pos[s] = r.prefilled
        return {"kind": "decode", "tokens": tokens, "pos": pos, "kv_len": None if compiled else max(pos) + 1}

    def _forward(self, op: Dict) -> torch.Tensor:
        dev = self.device
        if op["kind"] == "copy":
            self.model.copy_cache(torch.tensor(op["src"], device=dev), torch.tensor(op["dst"], device=dev), op["length"])
            return None
        if op["kind"] == "decode":
            x = torch.tensor(op["tokens"], device=dev)[:, None]
            start = time.perf_counter()
            logits = self.model(x, torch.tensor(op["pos"], device=dev), kv_len=op["kv_len"])[:, 0]
            step = getattr(self.model, "compiled_step", None)
            if op["kv_len"] is not None and step is not None and step.lazy:
                # compile="auto": an eager step counts toward compiling the all-slots graph that would replace it
                step.spent_eager(len(self.slots), None, time.perf_counter() - start)
            return logits
        x = torch.tensor(op["tokens"], device=dev)
        start = op["start"] if isinstance(op["start"], int) else torch.tensor(op["start"], device=dev)
        slots = None if op["slots"] == list(range(len(op["slots"]))) else torch.tensor(op["slots"], device=dev)
        last = None if op["last"] is None else torch.tensor(op["last"], device=dev)
        return self.model(x, start, rows=slots, logit_index=last, kv_len=op["kv_len"])

    def _prefill_results(self, jobs: List, ops: List[Dict], outs: List[torch.Tensor]) -> List:
        """Next-token logits of requests whose prompt is now complete; prompt logprobs where asked."""
        ready, k = [], 0
        for op, out in zip(ops, outs):
            if op["kind"] != "prefill":
                continue
            for i in range(len(op["slots"])):
                r, s, c = jobs[k]
                k += 1
                row = r.row
                if op["last"] is None:
                    if row.params.echo and row.params.logprobs:
                        end = min(s + c + 1, len(row.prompt))
                        row.prompt_logprobs = row.prompt_logprobs + token_logprobs(out[i, :c], row.prompt[s:end])
                    logits = out[i, c - 1]
                else:
                    logits = out[i, 0]
                if r.prefilled == len(row.prompt):
                    ready.append((r, logits))
        return ready

    def _advance(self, ready: List) -> None:
        """Sample one token per ready request (as Llama._run does) and retire the finished ones."""
        reqs = [r for r, _ in ready]
        rows = [r.row for r in reqs]
        logits = torch.stack([lg for _, lg in ready])
        failed = set()
        for b, r in enumerate(reqs):
            try:
                for proc in r.row.params.logits_processors:
                    logits[b] = proc(list(r.row.generated), logits[b])
            except Exception as e:
                if self._offline:
                    raise
                failed.add(b)
                self._retire(r, ValueError(f"request {r.handle.id}: a logits processor raised {e!r}"), "error")
        next_tok, lp = RowSampler(rows, self.device)(logits)
        eos = self.llama.tokenizer.eos_id
        for b, (req, tok) in enumerate(zip(reqs, next_tok)):
            if b in failed:
                continue
            r = req.row
            text = r.advance(tok, eos, lp[b] if lp is not None else None)
            if r.finish_reason is None:
                req.feed, req.feed_pos = tok, r.next_pos
            if text and req.handle is not None:
                req.handle._put(text)
            if r.finish_reason is not None:
                self._retire(req, None, r.finish_reason)

    def _retire(self, req: _Request, error: Optional[BaseException], reason: str) -> None:
        if self.slots[req.slot] is req:
            self.slots[req.slot] = None
        req.feed = None
        self.stats["finished"] += 1
        self.stats["generated_tokens"] += len(req.row.generated)
        self._settle(req, error, reason)

    def _settle(self, req: _Request, error: Optional[BaseException], reason: str) -> None:
        h = req.handle
        if h is None:
            return
        h.tokens_generated = len(req.row.generated)
        pred = None
        if error is None:
            pred = self.llama._prediction(req.row)
            if h.chat:
                pred["generation"] = {"role": "assistant", "content": pred["generation"]}
        h._settle(pred, error, reason)
