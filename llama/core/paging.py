"""The scheduler's side of the paged KV pool: a request's blocks from admission to retirement.

Admission reserves every block a request can write (prompt plus max_new, at most max_seq_len), minus the full
blocks of the longest cached prefix of its prompt, which it shares. Reserving up front means a running request
never waits for a block, so nothing is preempted mid-decode; a pool sized below the slots' footprint
(kv_cache_memory) then admits fewer requests at once, each as soon as its blocks are free. Retirement keys the
request's full blocks for later prompts (only tokens it accepted) and drops its references.

Modes (Llama(prefix_cache=...)): "on" keys prompt blocks and the blocks of a reply the decode steps wrote; "exact"
keys only blocks that a prefill wrote, so a cached position holds what a fresh prefill computes on every path (a
reply's positions are recomputed by the next turn's prefill, then cached); "off" keys nothing.
"""

from typing import List, Optional, Sequence, Tuple

from llama.core.block_pool import BlockPool
from llama.core.plan import CopyBlocks, SetBlocks
from llama.core.request import Request

MODES = ("on", "exact", "off")


def check_mode(mode) -> str:
    if mode is True:
        return "on"
    if mode is False or mode is None:
        return "off"
    if mode not in MODES:
        raise ValueError(f"prefix_cache must be True, False, 'on', 'exact' or 'off', got {mode!r}")
    return mode


class Paging:
    def __init__(self, pool: BlockPool, base: int, max_seq_len: int):
        self.pool, self.base, self.max_seq_len = pool, base, max_seq_len

    @property
    def mode(self) -> str:
        return getattr(self.pool, "mode", "on")

    def _salt(self, r: Request) -> Optional[bytes]:
        """The request's salt, or None where it takes no part in prefix caching (opted out, explicit prefix,
        echoed prompt scores: those positions are computed so their log-probabilities exist)."""
        if self.mode == "off" or r.cache_salt is None or r.prefix is not None or r.params.scores_prompt:
            return None
        return str(r.cache_salt).encode()

    def hits(self, r: Request) -> List[int]:
        """Cached blocks of r's prompt, leaving at least its last token to compute (its logits are needed)."""
        if r.prefix is not None:  # it continues a Prefix: share that prefix's full blocks (llama/core/prefix.py)
            return r.prefix.full_blocks(r.prompt)
        salt = self._salt(r)
        return [] if salt is None else self.pool.lookup(r.prompt, salt, limit=len(r.prompt) - 1)

    def need(self, r: Request) -> int:
        return self.pool.blocks_for(min(len(r.prompt) + r.max_new, self.max_seq_len))

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
        r.blocks = blocks
        if self._salt(r) is not None:
            self.pool.stats["prompt_tokens"] += len(r.prompt)
            self.pool.stats["cached_tokens"] += cached
        return SetBlocks(rows=[row], blocks=[blocks])

    def moved(self, r: Request, src_row: int, dst_row: int) -> SetBlocks:
        """A compaction move: the row's table moves, its blocks stay."""
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
        """Key the full prompt blocks a planned prefill chunk covers: later steps' prompts may share them (a
        failed step clears every key, DecodeCore._fail)."""
        salt = self._salt(r)
        if salt is not None:
            self.pool.publish(r.prompt[: r.prefilled], r.blocks, salt)

    def retired(self, r: Request) -> None:
        salt = self._salt(r)
        if salt is not None and r.error is None and r.blocks:
            written = r.cached if r.prefilled == len(r.prompt) and self.mode == "on" else r.prompt[: r.prefilled]
            self.pool.publish(written, r.blocks, salt)
        self.pool.release(r.blocks)
        r.blocks = []
