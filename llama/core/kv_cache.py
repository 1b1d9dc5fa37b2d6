"""The KV cache and its one owner: allocation, slot copies, prefix snapshots, and the lock that says who holds it.

The tensors live in each attention layer as buffers (so torch.compile sees them as the model's mutable state);
the model writes new keys/values during its forward pass, and everything else that touches them goes through
KVCache: the decode core copies a slot into another (n samples of one prompt, compaction), a Prefix is a snapshot
of a slot that later loads into another one.
"""

import threading
import weakref
from contextlib import contextmanager
from typing import List, Optional, Sequence, Tuple

import torch

Snapshot = List[Tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values (kv_heads, length, head_dim)


class KVCache:
    """max_batch_size slots of max_seq_len positions for every layer of `model`.

    A model has one cache at a time: allocating another replaces the tensors of the first, so build one Llama per
    model (Llama.build loads a fresh model each time).
    """

    def __init__(self, model, max_batch_size: int, max_seq_len: int, dtype=None, device=None):
        ref = model.norm.weight
        dtype, device = dtype or ref.dtype, device or ref.device
        self.layers = [layer.attention for layer in model.layers]
        for attn in self.layers:
            shape = (max_batch_size, attn.n_local_kv_heads, max_seq_len, attn.head_dim)
            attn.cache_k = torch.zeros(shape, dtype=dtype, device=device)
            attn.cache_v = torch.zeros(shape, dtype=dtype, device=device)
        model.setup_rope(max_seq_len, device)
        self.max_batch_size, self.max_seq_len, self.device = max_batch_size, max_seq_len, device
        self.lock = threading.RLock()  # one user of the slots at a time: a static batch, a stream or the engine
        self._stream_thread: Optional[int] = None  # the thread whose unfinished stream holds the cache
        self._prefixes: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        self._next_prefix = 0

    @contextmanager
    def hold(self, streaming: bool = False):
        """Hold the cache for one call. Other threads wait; in the thread of an unfinished stream (which holds the
        cache between its deltas) any other call would corrupt that stream, so it raises instead."""
        with self.lock:
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

    @torch.inference_mode()
    def copy_rows(self, src: Sequence[int], dst: Sequence[int], length: int) -> None:
        """Copy positions [0, length) of slots src into slots dst (n samples of a prompt, compaction)."""
        s = torch.tensor(list(src), device=self.device)
        d = torch.tensor(list(dst), device=self.device)
        for attn in self.layers:
            attn.cache_k[d, :, :length] = attn.cache_k[s, :, :length]
            attn.cache_v[d, :, :length] = attn.cache_v[s, :, :length]

    @torch.inference_mode()
    def snapshot(self, slot: int, length: int) -> Snapshot:
        """A copy of positions [0, length) of one slot, for every layer."""
        return [(a.cache_k[slot, :, :length].clone(), a.cache_v[slot, :, :length].clone()) for a in self.layers]

    @torch.inference_mode()
    def load(self, kv: Snapshot, slot: int, length: int) -> None:
        """Write the first `length` positions of a snapshot into a slot."""
        for attn, (k, v) in zip(self.layers, kv):
            attn.cache_k[slot, :, :length] = k[:, :length]
            attn.cache_v[slot, :, :length] = v[:, :length]

    def register(self, prefix) -> int:
        """An id for a prefix snapshot, the same on every model-parallel rank when they take snapshots in the
        same order (as they do), so a scheduled 'load' op can name it."""
        pid = self._next_prefix
        self._next_prefix += 1
        self._prefixes[pid] = prefix
        return pid

    def prefix(self, pid: int):
        try:
            return self._prefixes[pid]
        except KeyError:
            raise RuntimeError(f"prefix {pid} is no longer alive on this rank") from None
