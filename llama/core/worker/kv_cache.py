"""The KV cache and its one owner: a paged pool of blocks, the block table of every cache row, the blocks that
prefixes hold, and the lock that says who holds it.

The tensors live in each attention layer as buffers (so torch.compile sees them as the model's mutable state):
cache_k/cache_v (blocks, kv_heads, block_size, head_dim) (an int8 pool's scales beside them, cache_k_scales and
cache_v_scales) and one block table (rows, blocks per row) shared by every layer, whose layout between the runner's
passes each layer also holds (Attention.blocks, a llama/kernels/paged.py BlockTable); the model writes new
keys/values during its forward pass and reads them through the table. Everything else that touches them goes
through KVCache: the runner applies the scheduler's table edits and block copies (the n samples of a prompt share
its full blocks and copy the last, partial one), a Prefix (Llama.prefill, a chat session's last turn) keeps the
blocks of a row that ran and lends them to the rows that continue it the same way. Which blocks are free, shared or
cached is the BlockPool's (llama/core/scheduling/block_pool.py), kept on the planning rank only.

Default size: max_batch_size rows of max_seq_len positions, as many blocks as the slots held before paging, so
nothing grows unless asked (kv_cache_memory / kv_cache_tokens size it otherwise).
"""

import threading
import weakref
from contextlib import contextmanager
from typing import List, Optional, Sequence, Tuple

import torch

from llama.config.options import CacheConfig, SchedulerConfig
from llama.core.worker import exact
from llama.core.scheduling.block_pool import SCRATCH, BlockPool
from llama.kernels import invariant, paged

BLOCK_SIZE = 16


def bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over every layer of this rank (keys and values; int8: codes and an fp16 scale per
    group of a head, llama/kernels/paged.py)."""
    per = torch.empty((), dtype=dtype).element_size()
    head = lambda d: d * per + (2 * d // paged.group_size(d) if dtype == torch.int8 else 0)  # noqa: E731
    return sum(2 * block_size * layer.attention.n_local_kv_heads * head(layer.attention.head_dim)
               for layer in model.layers)


def pool_blocks(model, max_batch_size: int, max_seq_len: int, block_size: int, dtype: torch.dtype,
                memory: Optional[int] = None, tokens: Optional[int] = None) -> int:
    """Blocks of a pool sized by memory (bytes), by tokens, or by default as max_batch_size full rows; at least
    one full row (max_seq_len still bounds one sequence)."""
    row = -(-max_seq_len // block_size)
    if memory is not None:
        n = int(memory) // bytes_per_block(model, block_size, dtype)
        what = f"kv_cache_memory={memory} bytes"
    elif tokens is not None:
        n, what = -(-int(tokens) // block_size), f"kv_cache_tokens={tokens}"
    else:
        return max_batch_size * row
    if n < row:
        raise ValueError(f"{what} holds {n} blocks of {block_size} positions; one sequence of max_seq_len="
                         f"{max_seq_len} needs {row}: give the KV cache more room or lower max_seq_len")
    return n


def pool_salt(model, dtype: torch.dtype, block_size: int, place: Tuple[int, int]) -> bytes:
    """What, besides the tokens, decides a block's keys and values on this rank: the weights (this model object's
    parameters and their scheme), the KV dtype and layout, rope and the rank's place in model and pipeline parallel.
    Blocks never leave their pool, so today the pool's own identity already separates these; the salt keeps keys
    apart should blocks ever be shared or stored beyond one pool."""
    params = ",".join(f"{n}:{tuple(t.shape)}:{t.dtype}:{id(t)}" for n, t in list(model.named_parameters())[:4])
    form = paged.scheme(model.params.head_dim) if dtype == torch.int8 else ""  # int8: q8_0, rotated or not
    return repr((params, str(dtype), form, block_size, repr(model.params), place)).encode()


KV_DTYPES = {"int8": torch.int8}


def model_kv_dtype(model) -> torch.dtype:
    """The cache's default dtype: the model's, or fp16 for a model in llama.cpp's arithmetic (its KV cache's type;
    llama/kernels/ggml_arith.py), which holds the same values as fp32 in half the bytes."""
    return torch.float16 if model.norm.ggml_arith else model.norm.weight.dtype


def build_cache(model, scheduler: SchedulerConfig, cache: CacheConfig, place: Tuple[int, int] = (0, 0),
                replicated: bool = False) -> "KVCache":
    """The Llama facade's cache: the model's dtype (or cache.kv_dtype) and device, sized by cache.memory bytes
    (else scheduler.max_batch_size x max_seq_len positions). place: (model-parallel rank, pipeline stage);
    replicated: other ranks replay this one's steps."""
    if cache.prefix_cache == "exact":
        exact.check(model)
    ref = model.norm.weight
    dtype = KV_DTYPES.get(cache.kv_dtype, model_kv_dtype(model))
    size = (scheduler.max_batch_size, scheduler.max_seq_len)
    blocks = pool_blocks(model, *size, BLOCK_SIZE, dtype, memory=cache.memory)
    return KVCache(model, *size, dtype=dtype, device=ref.device, num_blocks=blocks,
                   salt=pool_salt(model, dtype, BLOCK_SIZE, place), prefix_cache=cache.prefix_cache,
                   replicated=replicated)


class KVCache:
    """A paged pool of blocks for max_batch_size rows of up to max_seq_len positions, in every layer of `model`.

    A model has one cache at a time: allocating another replaces the tensors of the first, so build one Llama per
    model (Llama.build loads a fresh model each time). prefix_cache: the pool's mode (config.options.PREFIX_CACHE_MODES); replicated:
    other ranks replay this one's steps.
    """

    def __init__(self, model, max_batch_size: int, max_seq_len: int, dtype=None, device=None,
                 block_size: int = BLOCK_SIZE, num_blocks: Optional[int] = None, salt: bytes = b"",
                 prefix_cache: str = "on", replicated: bool = False):
        ref = model.norm.weight
        dtype, device = dtype or model_kv_dtype(model), device or ref.device
        if num_blocks is None:
            num_blocks = pool_blocks(model, max_batch_size, max_seq_len, block_size, dtype)
        self.layers = [layer.attention for layer in model.layers]
        per_row = -(-max_seq_len // block_size)
        # Outside the runner's passes (a direct model call: Meta's code, tests) the table rests in the slot layout
        # of old, row r in blocks 1 + r * per_row ..., as far as the pool has blocks; see BlockTable.direct().
        self.blocks = paged.slot_table(max_batch_size, per_row, num_blocks, device, self._forget_prefixes)
        self.table = self.blocks.tensor
        self.replicated = replicated
        for attn in self.layers:
            shape = (num_blocks + 1, attn.n_local_kv_heads, block_size, attn.head_dim)  # + the scratch block
            attn.cache_k = torch.zeros(shape, dtype=dtype, device=device)
            attn.cache_v = torch.zeros(shape, dtype=dtype, device=device)
            attn.cache_k_scales = attn.cache_v_scales = None
            if dtype == torch.int8:  # a scale per group of a position's head (llama/kernels/paged.py)
                scales = (*shape[:-1], attn.head_dim // paged.group_size(attn.head_dim))
                attn.cache_k_scales = torch.zeros(scales, dtype=torch.float16, device=device)
                attn.cache_v_scales = torch.zeros(scales, dtype=torch.float16, device=device)
            attn.block_table, attn.blocks = self.table, self.blocks
        model.setup_rope(max_seq_len, device)
        self.max_batch_size, self.max_seq_len, self.device = max_batch_size, max_seq_len, device
        self.block_size, self.num_blocks, self.dtype = block_size, num_blocks, dtype
        self.pool = BlockPool(num_blocks, block_size, salt, prefix_cache)  # used on the planning rank only
        self.bytes = num_blocks * bytes_per_block(model, block_size, dtype)
        self.lock = threading.RLock()  # one user of the rows at a time: a static batch, a stream or the engine
        self._stream_thread: Optional[int] = None  # the thread whose unfinished stream holds the cache
        self._prefixes: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        self._next_prefix = 0
        self._dropped: list = []  # pins of prefixes closed or collected (any thread), released by drain()

    @contextmanager
    def hold(self, streaming: bool = False):
        """Hold the cache for one call. Other threads wait; in the thread of an unfinished stream (which holds the
        cache between its deltas) any other call would corrupt that stream, so it raises instead."""
        with self.lock:
            self.drain()
            if self._stream_thread == threading.get_ident():
                raise RuntimeError("an unfinished stream of this Llama is open in this thread: "
                                   "consume it or close() it before another call")
            if streaming:
                self._stream_thread = threading.get_ident()
            try:
                yield self
            finally:
                if streaming:
                    self._stream_thread = None

    # ------------------------------------------------------------------------------------------ block tables
    @contextmanager
    def manage(self):
        """The runner's passes: the scheduler's block tables are live. Under prefix_cache="exact" they compute every
        row by row-invariant arithmetic (llama/kernels/invariant.py), so a cached position holds what any fresh
        prefill computes, and a request's logits never depend on what else its passes hold."""
        with self.blocks.managed(), invariant.rows(self.pool.mode == "exact"):
            yield

    def _forget_prefixes(self) -> None:
        """A pass outside the runner (BlockTable.direct) writes the slot layout's blocks, which may hold cached
        prefixes: every prefix key is forgotten, and every prefix is computed afresh."""
        if self.pool.by_key:
            self.pool.clear()
        for prefix in list(self._prefixes.values()):  # their blocks may be in that layout: compute them afresh
            prefix.stale = True

    def set_blocks(self, rows: Sequence[int], blocks: Sequence[Sequence[int]]) -> None:
        """Row rows[i]'s table: blocks[i], then the scratch block."""
        for row, bl in zip(rows, blocks):
            self.table[row] = SCRATCH
            if bl:
                self.table[row, : len(bl)] = torch.tensor(list(bl), dtype=torch.int64, device=self.device)

    @contextmanager
    def borrow(self, rows: int, length: int):
        """Blocks for rows 0..rows-1 up to `length` positions during a pass outside the scheduler (scoring, a
        prefix), given back after it. Their table entries stay until the next table edit, so the caller (holding
        the cache) may still keep() their blocks. On model-parallel ranks every rank borrows alike."""
        per = self.pool.blocks_for(length)
        if self.replicated:
            self.pool.clear()  # the other ranks' pools do not know which blocks rank 0 keyed: forget them all
        blocks = self.pool.allocate(rows * per)
        if blocks is None:
            raise ValueError(f"{rows} sequence(s) of {length} positions need {rows * per} KV blocks; the pool has "
                             f"{self.pool.available()} free: use fewer at a time or a larger kv_cache_memory")
        try:
            self.set_blocks(range(rows), [blocks[i * per : (i + 1) * per] for i in range(rows)])
            yield
        finally:
            self.pool.release(blocks)

    @torch.inference_mode()
    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole blocks (copy on write: a twin's own copy of its source's last, partial prompt block)."""
        s = torch.tensor(list(src), device=self.device)
        d = torch.tensor(list(dst), device=self.device)
        for cache in self._tensors():
            cache[d] = cache[s]

    def _where(self, row: int, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(blocks, offsets) of a row's positions [0, length)."""
        pos = torch.arange(length, device=self.device)
        return self.table[row, pos // self.block_size], pos % self.block_size

    @torch.inference_mode()
    def copy_rows(self, src: Sequence[int], dst: Sequence[int], length: int) -> None:
        """Copy positions [0, length) of rows src into rows dst (through their tables: blocks dst owns)."""
        for s, d in zip(src, dst):
            sb, so = self._where(s, length)
            db, do = self._where(d, length)
            for cache in self._tensors():
                cache[db, :, do] = cache[sb, :, so]

    def _tensors(self) -> List[torch.Tensor]:
        """Every tensor a block spans: keys, values (and an int8 pool's scales)."""
        out = [t for a in self.layers for t in (a.cache_k, a.cache_v)]
        return out + [t for a in self.layers for t in (a.cache_k_scales, a.cache_v_scales) if t is not None]

    # ------------------------------------------------------------------------------------------ prefixes
    @torch.inference_mode()
    def continue_prefix(self, blocks: Sequence[int], row: int, length: int) -> None:
        """Give row the prefix's positions [0, length): the row already shares the prefix's full blocks (the
        scheduler reserved them), so this copies the blocks it does not share, the partial last one (copy on
        write: the row writes its own positions after it)."""
        k = self.pool.blocks_for(length)
        src = torch.tensor(list(blocks[:k]), dtype=torch.int64, device=self.device)
        dst = self.table[row, :k]
        differ = src != dst
        if bool(differ.any()):
            for cache in self._tensors():
                cache[dst[differ]] = cache[src[differ]]

    def keep(self, row: int, length: int) -> List[int]:
        """The blocks of a row that just ran, positions [0, length), taken back with one reference each for a
        Prefix. Its request has retired and released them, but nothing has reused them yet (the caller holds the
        cache and no table edit came since): keyed ones wait in the pool's LRU, the others are on its free list."""
        pool = self.pool
        blocks = [int(b) for b in self.table[row, : pool.blocks_for(length)].tolist()]
        lost = [b for b in blocks if b == SCRATCH or not (b in pool.refs or b in pool.lru or b in pool.free)]
        if lost:
            raise RuntimeError(f"row {row}'s block {lost[0]} is no longer the row's own: it cannot be kept")
        for b in blocks:
            if b not in pool.refs and b not in pool.lru:
                pool.free.remove(b)
                pool.refs[b] = 0  # acquire below gives it its one reference
        pool.acquire(blocks)
        return blocks

    def drop(self, pin) -> None:
        """A prefix's blocks are no longer needed (its close() or its finalizer, from any thread): release them at
        the next drain(), in the thread that plans."""
        self._dropped.append(pin)

    def drain(self) -> None:
        """Release the blocks of dropped prefixes (the planning thread, holding the cache, before it plans)."""
        while self._dropped:
            pin = self._dropped.pop()
            if not pin.released:
                pin.released = True
                self.pool.release(pin.blocks)

    def pool_state(self) -> dict:
        """The engine leader's pool when it stops, dropped prefixes released first (BlockPool.adopt says why)."""
        with self.lock:
            self.drain()
            return self.pool.state()

    def adopt_pool(self, state: dict) -> None:
        """A follower takes the leader's pool; prefixes dropped meanwhile were the leader's to release too."""
        with self.lock:
            self.drain()
            self.pool.adopt(state)

    def register(self, prefix) -> int:
        """An id for a prefix, the same on every model-parallel rank when they make prefixes in the same order
        (as they do), so a scheduled LoadPrefix op can name it."""
        pid = self._next_prefix
        self._next_prefix += 1
        self._prefixes[pid] = prefix
        return pid

    def prefix(self, pid: int):
        try:
            return self._prefixes[pid]
        except KeyError:
            raise RuntimeError(f"prefix {pid} is no longer alive on this rank") from None
