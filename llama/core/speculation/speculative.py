"""Speculative decoding that never changes an output: draft a few tokens cheaply, check them in one forward pass.

Why it is exact. A request's k drafted tokens go through a Verify pass (llama/core/scheduling/plan.py) together with its last
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

Drafts (llama/sample/lookup.py): a request's predicted output (SamplingParams.prediction, OpenAI's Predicted
Outputs), followed in order, then prompt lookup over its prompt and output. Predictions are drafted from wherever
the decode step is eager (Llama.build(compile=False), the server's default) or compiled where a Verify pass through
it is bitwise (compile=True, fp32 in our kernels: CompiledDecode.verifies_exactly), speculative="ngram" or not;
prompt lookup for every request only with speculative="ngram".

When a draft is verified (Speculator, one per scheduler). Verifying k drafted tokens costs c(k) = t(rows + k) /
t(rows) decode steps and yields E(k) = 1 + a + ... + a^k tokens, a being the chance that a drafted token is accepted.
A step verifies the drafts whose E/c beats plain decoding (oldest request first, at most MAX_ROWS rows, k chosen
per request), else it decodes plainly:
- t(rows) is measured on the machine it runs on, per row count: the time from one step's plan to the next, for
  steps that ran only decoding (llama/core/speculation/step_times.py: a table, interpolated, not a line). A 135M-parameter
  model on a busy 2-core CPU is compute-bound (a 2-row step cost 1.85 1-row steps), a 7B one memory-bound (about
  1): the same draft pays on one and not the other. Past the row counts timed, and under model parallel (every
  rank must plan alike, so nothing timed decides), a row costs PRIOR_SLOPE of a step.
- a is the request's own acceptance (hits and misses, fading by DECAY per step) over a prior of strength PRIOR: the
  acceptance of this kind of draft in this generator so far, over the kind's first guess (a prediction:
  PREDICTION_PRIOR; an n-gram match followed back m tokens: m / (m + 2), ngram_kind).
- with no draft worth verifying for EXPLORE steps, one 1-token draft is verified anyway, so stale times and rates
  are measured afresh (at most 1 in EXPLORE steps pays c(1) - 1 for nothing); a draft model's, only for a request
  it already holds (else that step would pay a prompt pass of the draft model too);
- never while more than MAX_BATCH requests decode (a batch already reads each weight for several tokens: llama.cpp
  measured 0.77x at 8 slots), and never for a request whose SamplingParams say speculative=False.
"""

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from llama import settings
from llama.config.options import speculative_mode
from llama.core.scheduling.plan import CopyBlocks, Decode, Plan, SetBlocks, Verify
from llama.core.frontend.request import Request
from llama.core.speculation.step_times import StepTimes
from llama.sample.lookup import NgramIndex, Prediction

MAX_BATCH = 4  # decoding requests in a step past which no one drafts
MAX_ROWS = 8  # rows of one Verify pass (the drafting requests' k+1, one for each other decoding request)
K_MAX = 7  # longest draft (k+1 <= MAX_ROWS)
PRIOR = 2.0  # strength of an acceptance prior (the kind's over a request, a kind's first guess), in drafted tokens
PREDICTION_PRIOR = 0.8  # a user's predicted output is, by its nature, mostly what comes
DRAFT_PRIOR = 0.6  # a draft model's first guess (a small model of the same family agrees about this often)
DECAY = 0.97  # a request's own evidence fades by this per step (drafts 23 steps back count half)
EXPLORE = 100  # steps without a verify after which one 1-token draft is verified anyway
MARGIN = 1.1  # a verify step must promise this many times plain decoding's tokens per second (times are noisy)
MEASURE = True  # time the steps (off: every plan depends on the tokens alone, as under model parallel)


def ngram_kind(matched: int) -> Tuple[str, float]:
    """A prompt-lookup draft's kind by its match length (1, 2, 3, 4-7, 8-15, 16+ tokens) and its first guess of
    acceptance, m / (m + 2) for the shortest m of the kind: a chance match of one token is a poor bet (1/3), a copy
    followed for 16 tokens a good one (8/9), so an echo or an edit drafts from its first steps on."""
    m = matched if matched <= 3 else 4 if matched < 8 else 8 if matched < 16 else 16
    return f"ngram{m}", m / (m + 2)


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step emits for a k-token draft whose tokens are each accepted with chance a: 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


class _State:
    """One request's drafting state: its draft sources, the tokens they have seen, its own acceptance."""

    def __init__(self, r: Request):
        self.index, self.tokens, self.synced = NgramIndex(), list(r.prompt), 0
        predicted = getattr(r, "predicted", None)
        self.prediction = Prediction(predicted) if predicted else None
        self.hits = self.misses = 0.0
        self.kind = ""  # the source of its draft in flight

    def context(self, r: Request) -> List[int]:
        """Prompt + generated, kept in step incrementally (the output only grows while the request decodes)."""
        g = r.generated
        if len(g) < self.synced:
            self.index, self.tokens, self.synced = NgramIndex(), list(r.prompt), 0
        self.tokens += g[self.synced:]
        self.synced = len(g)
        return self.tokens


class Memory:
    """What a generator's speculators learn and keep across calls (each Llama call has a scheduler of its own): the
    step times, the acceptance per kind of draft, the steps since the last verify."""

    def __init__(self):
        lockstep = torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1
        measure = MEASURE and settings.get().speculative_timing == "measured"
        self.times = StepTimes(measure=measure and not lockstep)
        self.rates: Dict[str, List[float]] = {}  # draft kind -> [accepted, missed] drafted tokens
        self.idle = 0  # steps since the last Verify


class Speculator:
    """Drafts for a scheduler's decoding requests and, where verifying pays, turns its step's Decode op into a Verify
    op (the decode core runs it after the scheduler plans: drafting is a step of its own); told after the step how
    many drafted tokens each request accepted (Plan.accepted).
    mode None: only requests with a prediction draft."""

    def __init__(self, stats: dict, base: int, max_seq_len: int, block_size: int = 0, mode: Optional[str] = "ngram",
                 memory: Optional["Memory"] = None, drafter=None):
        self.stats, self.base, self.max_seq_len, self.block_size = stats, base, max_seq_len, block_size
        self.mode = speculative_mode(mode)
        if self.mode == "draft" and drafter is None:
            raise ValueError("speculative='draft' drafts with a draft model: build the Llama with draft_model=PATH")
        self.drafter = drafter  # a DraftModel (llama/core/speculation/draft_model.py) under mode "draft"
        for key in ("verify_steps", "drafted_tokens", "accepted_tokens"):
            stats.setdefault(key, 0)
        memory = Memory() if memory is None else memory
        self.memory, self.times, self.rates = memory, memory.times, memory.rates
        self._states: Dict[int, _State] = {}  # by request id, for the requests decoding

    def _draft(self, r: Request, limit: int) -> Tuple["List[int] | int", float]:
        """Up to limit tokens drafted for r, and the chance each is accepted; a draft model's draft is a length
        (limit), drafted by _tokens once its length is chosen (each token costs a pass of the draft model)."""
        st = self._states.get(r.id)
        if st is None:
            st = self._states[r.id] = _State(r)
        st.hits, st.misses = st.hits * DECAY, st.misses * DECAY
        if limit <= 0 or not getattr(r.params, "speculative", True) or r.feed is None:
            return [], 0.0
        d = st.prediction.draft(r.generated, limit) if st.prediction is not None else []
        st.kind, first = "prediction", PREDICTION_PRIOR
        if not d and self.mode == "draft":
            st.kind = "draft"
            return limit, self.acceptance(st, DRAFT_PRIOR)
        if not d and (self.mode is not None or st.prediction is not None):
            d = st.index.draft(st.context(r), limit)
            st.kind, first = ngram_kind(st.index.matched)
        if not d:
            return [], 0.0
        return d, self.acceptance(st, first)

    def acceptance(self, st: "_State", first: float) -> float:
        """The chance a token of st's draft in flight is accepted: st's own evidence over its kind's, the kind's
        over its first guess."""
        hit, miss = self.rates.get(st.kind, (0.0, 0.0))
        kind = (hit + PRIOR * first) / (hit + miss + PRIOR)
        return (st.hits + PRIOR * kind) / (st.hits + st.misses + PRIOR)

    def _limit(self, r: Request) -> int:
        """The longest draft r has room for: the step emits at most k+1 tokens of max_new, and writes positions up to
        next_pos + k, within the cache and the blocks the request holds (a draft never takes a block of its own)."""
        end = self.max_seq_len
        if self.block_size and r.blocks:
            end = min(end, len(r.blocks) * self.block_size)
        return min(K_MAX, r.max_new - len(r.generated) - 1, end - 1 - r.next_pos)

    def choose(self, decoding: Sequence[Request], width: int, budget: int = MAX_ROWS) -> Dict[Request, List[int]]:
        """The drafts worth verifying this step, each cut to its best length (see the module's note), budget drafted
        tokens in all."""
        t = self.times.cost()
        tokens, rows = float(len(decoding)), len(decoding)
        best = tokens / t(width)
        chosen, fallback = {}, None
        for r in sorted(decoding, key=lambda r: r.order):
            d, a = self._draft(r, min(self._limit(r), MAX_ROWS - rows, budget - (rows - len(decoding))))
            n = d if isinstance(d, int) else len(d)
            if not n:
                continue
            if not isinstance(d, int) or self.drafter.holds(r, self.base + r.slot):  # exploring costs no prompt pass
                fallback = fallback or (r, d)
            gains = [((tokens + expected_tokens(a, k) - 1) / t(rows + k), k) for k in range(1, n + 1)]
            rate, k = max(gains)
            if rate > best * (MARGIN if self.times.measure else 1.0):  # the margin is for noisy times
                chosen[r], best = self._tokens(r, d, k), rate
                tokens, rows = tokens + expected_tokens(a, k) - 1, rows + k
        if not chosen and fallback is not None and self.memory.idle >= EXPLORE:
            chosen[fallback[0]] = self._tokens(*fallback, 1)
        return chosen

    def _tokens(self, r: Request, d: "List[int] | int", k: int) -> List[int]:
        """The first k tokens of r's draft (a draft model's, drafted now)."""
        if not isinstance(d, int):
            return d[:k]
        return self.drafter.draft(r, self.base + r.slot, r.prompt, self._states[r.id].context(r), k)

    def plan(self, plan: Plan, budget: int = MAX_ROWS) -> None:
        """Draft for plan.decoding; where verifying pays, verify every decoding request in one pass instead of the
        Decode op. budget: the drafted tokens the step has room for (the scheduler's prefill budget left)."""
        start, decoding = time.perf_counter(), plan.decoding
        if self.mode is None and not any(getattr(r, "predicted", None) for r in decoding):
            return  # no prediction among them: nothing to draft, nothing to time
        (decode,) = [op for op in plan.ops if isinstance(op, Decode)]
        width = max(decode.active) + 1
        pure = all(isinstance(op, (Decode, SetBlocks, CopyBlocks)) for op in plan.ops)
        ids = {r.id for r in decoding}
        for gone in set(self._states) - ids:
            del self._states[gone]
        drafts = self.choose(decoding, width, budget) if len(decoding) <= MAX_BATCH and self.times.knows(width) else {}
        if self.drafter is not None and self.drafter.once_off():  # a draft model's prompt or long catch-up: untimed
            pure = False
        if not drafts:
            self.memory.idle += 1
            self.times.tick(start, width if pure else 0, ids)
            return
        self.memory.idle = 0
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
        plan.decoding = []
        self.stats["verify_steps"] += 1
        self.times.tick(start, len(tokens) if pure else 0, ids)

    def accepted(self, r: Request, draft: List[int], n: int) -> None:
        """r accepted the first n tokens of its draft: count them, for r, its kind of draft and the stats."""
        if not draft:
            return
        self.stats["drafted_tokens"] += len(draft)
        self.stats["accepted_tokens"] += n
        if hasattr(r, "drafted"):
            r.drafted += len(draft)
            r.accepted += n
        st = self._states.get(r.id)
        if st is None:
            return
        miss = float(n < len(draft))
        st.hits, st.misses = st.hits + n, st.misses + miss
        rate = self.rates.setdefault(st.kind, [0.0, 0.0])
        rate[0], rate[1] = rate[0] + n, rate[1] + miss
        if sum(rate) > 256:  # the kind's rate follows what is generated now
            rate[0], rate[1] = rate[0] / 2, rate[1] / 2


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
            else:
                plan.accepted.append((r, d, i))
        if going:
            deltas += sample([(r, logits[f + i + 1]) for r, _, f in going])
        live, i = going, i + 1
    return deltas
