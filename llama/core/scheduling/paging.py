"""The scheduler's side of the paged KV pool: a request's blocks from admission to retirement, and preemption.

Blocks grow with use (vLLM's policy), so the pool holds what sequences have written, within one block per sequence:
admission reserves the blocks of the prompt and of the first token the request decodes, minus the full blocks of
the longest cached prefix of its prompt, which it shares; before each step, every request about to decode past
its last block gets the next one (oldest requests first). A pool sized below the slots' footprint
(kv_cache_memory) admits a request as soon as its prompt's blocks are free, first come, first served.

When a decoding request needs a block and the pool has none (none free, none cached and unreferenced), the most
recently admitted running request is preempted (recompute, as vLLM): its accepted blocks are keyed for the prefix
cache (as at retirement, when its salt allows), its references dropped, and it goes back to the front of the
queue with everything it generated. Re-admitted, it prefills its prompt and its generated tokens but the last
(`Request.context`), mostly from the blocks it just keyed, and feeds the last one to the next decode step: nothing
is sampled twice, so seeded draws (a function of the token's index), logprobs, stop strings, grammars and the
text stream go on where they were. The oldest request can always grow (the pool holds at least one max_seq_len
sequence), so every request finishes.

Modes (Llama(prefix_cache=...)): "on" and "exact" key prompt blocks and the blocks of a reply the decode steps wrote;
"exact"'s passes compute every row by row-invariant arithmetic (llama/kernels/invariant.py, turned on by
KVCache.manage), a decode step's row as a prefill's, so a cached position holds bitwise what a fresh prefill
computes, and a request's logits do not depend on its prefill's chunks, its passes' KV length, what else they hold,
or whether it was preempted and recomputed (fp32, bf16, int8, int8-dynamic, int4
and GGUF block weights on our CPU kernels, with a bf16/fp32 or an int8 KV pool, sliding windows and attention
multipliers included: the kernel applies both; compile=True is refused with it, and so are CUDA, fp16 and
head_dims our kernel does not take, where its arithmetic would not be row-invariant: llama/core/worker/exact.py);
"off" keys nothing.

What a preempted request recomputes is prefill arithmetic where the un-preempted run had decode arithmetic: under
"on" its reply's full blocks come back from the cache as the decode steps wrote them and only its last, partial
block is recomputed; under "off" (or for an opted-out request) its whole reply is. In fp32 the two differ in their
last bits only, and the tokens are the un-preempted run's (tests/core/scheduling/test_preemption.py); in bf16 or with
quantized kernels a recomputed position can change a later token: docs/performance.md, "Preemption", measures the
rate. Under "exact" the two are one arithmetic, so its tokens and logprobs are bitwise the un-preempted run's
(tests/core/worker/test_exact_preemption.py).
"""

from typing import List, Optional, Sequence, Tuple

from llama.core.scheduling.block_pool import BlockPool
from llama.core.scheduling.plan import CopyBlocks, SetBlocks
from llama.core.frontend.request import Request


class Paging:
    def __init__(self, pool: BlockPool, base: int, max_seq_len: int, lookahead: int = 0):
        """lookahead: steps ahead a decoding request's blocks reach (0 or 1): with asynchronous decode
        (llama/core/worker/ahead.py) a step is queued only inside held blocks, so the block the next step writes is taken
        one step early."""
        self.pool, self.base, self.max_seq_len = pool, base, max_seq_len
        self.stale: set = set()  # rows whose requests left: their tables still name blocks others may get
        self.lookahead = lookahead

    @property
    def mode(self) -> str:
        return self.pool.mode

    def _salt(self, r: Request) -> Optional[bytes]:
        """The request's salt, or None where it takes no part in prefix caching (opted out, explicit prefix,
        echoed prompt scores: those positions are computed so their log-probabilities exist)."""
        if self.mode == "off" or r.cache_salt is None or r.prefix is not None or r.params.scores_prompt:
            return None
        return str(r.cache_salt).encode()

    def hits(self, r: Request) -> List[int]:
        """Cached blocks of r's context, leaving at least its last token to compute (its logits are needed) unless
        it resumes after a preemption (its next token is known)."""
        if r.prefix is not None:  # it continues a Prefix: share that prefix's full blocks (llama/core/frontend/prefix.py)
            return r.prefix.full_blocks(r.prompt)
        salt, tokens = self._salt(r), r.context
        return [] if salt is None else self.pool.lookup(tokens, salt, limit=len(tokens) - (not r.generated))

    def need(self, r: Request) -> int:
        """Blocks for r's context and the first token it decodes."""
        return self.pool.blocks_for(min(len(r.context) + 1, self.max_seq_len))

    def reserve(self, group: Sequence[Request], nothing_runs: bool) -> List[Tuple[Request, List[int], int]]:
        """(request, blocks, cached positions) for the longest start of group whose blocks the pool has now: the
        whole group, or (when nothing else runs, so no later moment has more room) as many as fit."""
        hit = self.hits(group[0])
        idle_hits = sum(b in self.pool.lru for b in hit)
        fresh = [self.need(group[0]) - len(hit)] + [self.need(r) for r in group[1:]]
        room = self.pool.available() - idle_hits
        take = len(group)
        while take and sum(fresh[:take]) > room:
            if not nothing_runs:
                return []
            take -= 1
        out = []
        for k, r in enumerate(group[:take]):
            shared = hit if k == 0 else []
            self.pool.acquire(shared)
            out.append((r, shared + self.pool.allocate(fresh[k]), len(shared) * self.pool.block_size))
        return out

    def admitted(self, r: Request, row: int, blocks: List[int], cached: int) -> SetBlocks:
        r.blocks, r.prefilled = blocks, cached
        self.stale.discard(row)
        if not r.generated:  # a resumed request's recompute is neither prompt nor hit in the counts
            r.reused = cached
            if self._salt(r) is not None:
                self.pool.stats["prompt_tokens"] += len(r.prompt)
                self.pool.stats["cached_tokens"] += cached
        return SetBlocks(rows=[row], blocks=[blocks])

    def moved(self, r: Request, src_row: int, dst_row: int) -> SetBlocks:
        """A compaction move: the row's table moves, its blocks stay."""
        self.stale.discard(dst_row)
        return SetBlocks(rows=[dst_row, src_row], blocks=[r.blocks, []])

    def share(self, r: Request, src: Request, row: int) -> list:
        """r (a twin) takes src's full prompt blocks and a copy of its partial last one (copy on write)."""
        full = len(r.prompt) // self.pool.block_size
        self.pool.acquire(src.blocks[:full])
        self.pool.release(r.blocks[:full])
        r.blocks = src.blocks[:full] + r.blocks[full:]
        ops: list = [SetBlocks(rows=[row], blocks=[r.blocks])]
        if len(r.prompt) % self.pool.block_size:
            ops.append(CopyBlocks(src=[src.blocks[full]], dst=[r.blocks[full]]))
        return ops

    def prefilled(self, r: Request) -> None:
        """Key the full blocks a planned prefill chunk covers: later steps' prompts may share them (a failed step
        clears every key, DecodeCore._fail)."""
        salt = self._salt(r)
        if salt is not None:
            self.pool.publish(r.context[: r.prefilled], r.blocks, salt)

    def _written(self, r: Request) -> List[int]:
        """The accepted tokens whose keys and values r's blocks hold, as far as the mode keys them."""
        if r.prefilled == len(r.context) and self.mode in ("on", "exact"):
            return r.cached
        return r.context[: r.prefilled]

    def retired(self, r: Request) -> None:
        salt = self._salt(r)
        if salt is not None and r.error is None and r.blocks:
            self.pool.publish(self._written(r), r.blocks, salt)
        self.pool.release(r.blocks)
        r.blocks = []
        self.stale.add(self.base + r.slot)

    # ------------------------------------------------------------------------------------------ growth, preemption
    def grow(self, sched) -> List[SetBlocks]:
        """Before a step's prefill and decode: clear the tables of rows that were left (a free row inside the decode
        batch writes a dummy token through its table), let resumed requests whose recompute is done decode again,
        and give every decoding request the block its token writes, oldest first, preempting the most recently
        admitted when the pool is dry."""
        ops = [SetBlocks(rows=[row], blocks=[[]]) for row in sorted(self.stale)]
        self.stale.clear()
        for r in sorted(sched.running(), key=lambda r: r.order):
            if r.slot < 0:  # preempted below
                continue
            if r.feed is None and r.generated and r.prefilled == len(r.context):  # resumed, recomputed
                r.feed = r.generated[-1]
            if r.feed is None:
                continue
            more = self.pool.blocks_for(r.next_pos + 1) - len(r.blocks)
            while more > 0:
                got = self.pool.allocate(more)
                if got is not None:
                    ops.append(self._extend(r, got))
                    break
                victim = max(sched.running(), key=lambda v: v.order)
                ops.append(self.preempt(victim, sched))
                if victim is r:
                    break
        if self.lookahead:
            ops += self._ahead(sched)
        return ops

    def _ahead(self, sched) -> List[SetBlocks]:
        """The block each decoding request's next step will write, taken now when blocks are available (never by
        preempting, and after every request's block for this step, so it takes nothing this step needs). Not while
        requests wait for a free slot: they need blocks to be admitted, and no step is queued ahead then anyway."""
        ops = []
        if sched.waiting and None in sched.slots:
            return ops
        for r in sorted(sched.running(), key=lambda r: r.order):
            if r.slot < 0 or r.feed is None or len(r.generated) + 2 > r.max_new:
                continue
            more = self.pool.blocks_for(min(r.next_pos + 2, self.max_seq_len)) - len(r.blocks)
            got = self.pool.allocate(more) if more > 0 else None
            if got is not None:
                ops.append(self._extend(r, got))
        return ops

    def _extend(self, r: Request, blocks: List[int]) -> SetBlocks:
        r.blocks = r.blocks + blocks
        return SetBlocks(rows=[self.base + r.slot], blocks=[r.blocks])

    def preempt(self, r: Request, sched) -> SetBlocks:
        """Free r's blocks (keying its accepted ones first) and queue it at the front, to be recomputed."""
        salt = self._salt(r)
        if salt is not None and r.blocks:
            self.pool.publish(self._written(r), r.blocks, salt)
        self.pool.release(r.blocks)
        row = self.base + r.slot
        sched.slots[r.slot], r.slot, r.blocks = None, -1, []
        sched.waiting.appendleft(r)
        if r.generated:  # it goes on from its tokens, no longer from a twin's prompt
            r.resumed, r.feed, r.twin = r.fed, None, None
        else:  # nothing sampled yet: it starts over
            r.prompt_logprobs, r.prompt_top_logprobs = [], []
        r.prefilled = 0
        self.pool.stats["preemptions"] += 1
        sched.stats["preemptions"] += 1
        return SetBlocks(rows=[row], blocks=[[]])
