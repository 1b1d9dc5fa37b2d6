"""The paged KV pool's bookkeeping: which blocks are free, who references them, and which full blocks hold a
known run of tokens (automatic prefix caching). Pure data on the planning rank: the scheduler allocates and
releases blocks here and names them in its ops (llama/core/scheduling/plan.py), so model-parallel followers and pipeline stages
only ever apply block tables; the tensors are llama/core/worker/kv_cache.py's.

A full block is keyed by a hash chain: the key of block i hashes the key of block i - 1, the block's tokens and a
salt. The chain makes a block's key name every token before its end, so equal keys mean equal keys/values (up to
the arithmetic that wrote them, see docs/architecture.md). The pool's salt names everything else that changes a
block's contents (the weights, quantization, KV dtype, rope, this rank's place in model and pipeline parallel);
a request's salt (the server's per-API-key salt, vLLM's cache_salt) keeps tenants apart.

Block 0 is the scratch block: every unallocated table entry names it, so padding and dummy decode rows write
there and nothing reads it unmasked. Usable blocks are 1..num_blocks.
"""

import hashlib
from collections import OrderedDict, deque
from typing import Dict, List, Optional, Sequence

from llama.config.options import PREFIX_CACHE_MODES

SCRATCH = 0


def chain_keys(tokens: Sequence[int], block_size: int, salt: bytes, blocks: Optional[int] = None) -> List[bytes]:
    """Keys of the first `blocks` full blocks of tokens (all full blocks by default)."""
    n = len(tokens) // block_size if blocks is None else min(blocks, len(tokens) // block_size)
    keys, key = [], salt
    for i in range(n):
        h = hashlib.blake2b(key, digest_size=16)
        h.update(b",".join(str(t).encode() for t in tokens[i * block_size : (i + 1) * block_size]))
        key = h.digest()
        keys.append(key)
    return keys


class BlockPool:
    """num_blocks blocks of block_size positions: free ones, referenced ones, and cached ones (a key, no
    references) kept for reuse and evicted least recently used when the pool needs room. mode: prefix_cache's
    (PREFIX_CACHE_MODES: on, exact, off; llama/config/ reads the user's value), fixed for the pool's life."""

    def __init__(self, num_blocks: int, block_size: int, salt: bytes = b"", mode: str = "on"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one position, got {num_blocks} "
                             f"blocks of {block_size}")
        if mode not in PREFIX_CACHE_MODES:
            raise ValueError(f"a KV pool's prefix_cache mode must be one of {PREFIX_CACHE_MODES}, got {mode!r}")
        self.num_blocks, self.block_size, self.salt, self.mode = num_blocks, block_size, salt, mode
        self.free: deque = deque(range(1, num_blocks + 1))
        self.refs: Dict[int, int] = {}
        self.key_of: Dict[int, bytes] = {}
        self.by_key: Dict[bytes, int] = {}
        self.lru: "OrderedDict[int, None]" = OrderedDict()  # cached blocks nobody references, oldest first
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "evictions": 0, "preemptions": 0}

    # ------------------------------------------------------------------------------------------ accounting
    def available(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones nobody references (evicted on demand)."""
        return len(self.free) + len(self.lru)

    def used(self) -> int:
        """Blocks some sequence references."""
        return len(self.refs)

    def cached(self) -> int:
        """Blocks kept only for their key."""
        return len(self.lru)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # ------------------------------------------------------------------------------------------ blocks
    def allocate(self, n: int) -> Optional[List[int]]:
        """n fresh blocks with one reference each (evicting cached ones, least recently used first), or None
        (nothing taken) when the pool has fewer than n available."""
        if n > self.available():
            return None
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.lru.popitem(last=False)
                del self.by_key[self.key_of.pop(b)]
                self.stats["evictions"] += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each block (a prefix hit, a twin sharing its source's prompt)."""
        for b in blocks:
            if b in self.lru:
                del self.lru[b]
            self.refs[b] = self.refs.get(b, 0) + 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block: one nobody references is kept if it has a key, else freed."""
        for b in blocks:
            if b == SCRATCH:
                continue
            left = self.refs[b] - 1
            if left:
                self.refs[b] = left
                continue
            del self.refs[b]
            if b in self.key_of:
                self.lru[b] = None  # most recently used last
            else:
                self.free.append(b)

    # ------------------------------------------------------------------------------------------ prefix cache
    def lookup(self, tokens: Sequence[int], salt: bytes = b"", limit: Optional[int] = None) -> List[int]:
        """The cached blocks of the longest run of full blocks at the start of tokens (at most `limit` positions),
        not yet acquired."""
        blocks = []
        n = len(tokens) if limit is None else min(limit, len(tokens))
        for key in chain_keys(tokens[:n], self.block_size, self.salt + salt):
            b = self.by_key.get(key)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def publish(self, tokens: Sequence[int], blocks: Sequence[int], salt: bytes = b"") -> None:
        """Key the full blocks of a sequence whose first len(tokens) positions are written (and final: only
        accepted tokens, so a speculative rollback never publishes). A key already held by another block keeps
        that block."""
        for key, b in zip(chain_keys(tokens, self.block_size, self.salt + salt), blocks):
            if b in self.key_of or key in self.by_key:
                continue
            self.key_of[b], self.by_key[key] = key, b

    # ------------------------------------------------------------------------------------------ followers
    def state(self) -> dict:
        """What a pool that plans as this one must hold (picklable)."""
        return {"free": list(self.free), "refs": dict(self.refs), "key_of": dict(self.key_of), "lru": list(self.lru),
                "salt": self.salt, "stats": dict(self.stats)}

    def adopt(self, state: dict) -> None:
        """Become the pool whose state() this is. Model-parallel followers and pipeline stages replay the engine
        leader's block tables without planning, so when the engine stops their pools take the leader's: a later
        lockstep call then plans the same blocks and cache hits on every rank. Its salt comes too (the keys were
        made with it); a follower's blocks stay its own, so nothing is shared across ranks by it."""
        self.free, self.refs = deque(state["free"]), dict(state["refs"])
        self.key_of = dict(state["key_of"])
        self.by_key = {key: b for b, key in self.key_of.items()}
        self.lru = OrderedDict.fromkeys(state["lru"])
        self.salt, self.stats = state["salt"], dict(state["stats"])

    def clear(self) -> None:
        """Forget every key: cached blocks nobody references are freed, referenced ones stay in use unkeyed."""
        for b in self.lru:
            self.free.append(b)
        self.lru.clear()
        self.key_of.clear()
        self.by_key.clear()
