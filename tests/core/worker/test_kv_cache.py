"""The paged KV pool: block bookkeeping (refcounts, LRU eviction, prefix keys), block tables, the kernels that read
through them, and the scheduler's use of them (admission by free blocks, moves and twins as table edits)."""

import hardware
import pytest
import torch
from test_model import random_model

from llama.core.scheduling.block_pool import SCRATCH, BlockPool, chain_keys
from llama.core.worker.kv_cache import KVCache, bytes_per_block, pool_blocks
from llama.kernels import cpu
from llama.kernels import paged


def test_pool_allocates_refcounts_and_frees():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and SCRATCH not in a and pool.available() == 1 and pool.used() == 3
    assert pool.allocate(2) is None and pool.available() == 1  # nothing taken on refusal
    pool.acquire(a[:1])
    pool.release(a)
    assert pool.used() == 1 and pool.available() == 3  # a[0] still has its second reference
    pool.release(a[:1])
    assert pool.used() == 0 and pool.available() == 4


def test_cached_blocks_are_kept_then_evicted_least_recently_used():
    pool = BlockPool(4, 2)
    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    a = pool.allocate(2)
    pool.publish(first, a)
    pool.release(a)  # finished: its blocks are kept, keyed
    assert pool.cached() == 2 and pool.available() == 4 and pool.lookup(first + [9]) == a
    b = pool.allocate(2)
    assert not set(a) & set(b)  # free blocks go before cached ones
    pool.publish(second, b)
    pool.release(b)
    hit = pool.lookup(first)  # a hit makes `first` the most recently used
    pool.acquire(hit)
    assert pool.available() == 2  # blocks in use are not evictable
    pool.release(hit)
    assert pool.allocate(1) == [b[0]] and pool.stats["evictions"] == 1
    assert pool.lookup(second) == [] and pool.lookup(first) == a  # the chain breaks at the evicted block


def test_keys_chain_every_token_and_the_salt():
    a = chain_keys([1, 2, 3, 4, 5], 2, b"")
    assert len(a) == 2  # full blocks only
    assert chain_keys([9, 2, 3, 4], 2, b"")[1] != a[1]  # block 1's key depends on block 0's tokens
    assert chain_keys([1, 2, 3, 4], 2, b"tenant")[0] != a[0]
    pool = BlockPool(4, 2)
    b = pool.allocate(2)
    pool.publish([1, 2, 3, 4], b, b"alice")
    assert pool.lookup([1, 2, 3, 4, 5], b"alice") == b
    assert pool.lookup([1, 2, 3, 4, 5], b"bob") == []
    assert pool.lookup([1, 2, 3, 4, 5], b"alice", limit=3) == b[:1]
    pool.clear()
    assert pool.lookup([1, 2, 3, 4], b"alice") == []


def test_pool_sizes_by_memory_and_refuses_less_than_one_row():
    model = random_model(seed=0, max_batch=2)
    per = bytes_per_block(model, 16, torch.float32)
    a = model.params
    assert per == 2 * a.n_layers * 16 * a.n_kv_heads * a.head_dim * 4  # K and V, layers, positions, heads, fp32
    assert pool_blocks(model, 4, 64, 16, torch.float32) == 16  # default: today's slots
    assert pool_blocks(model, 4, 64, 16, torch.float32, memory=10 * per) == 10
    with pytest.raises(ValueError, match="one sequence of max_seq_len=64 needs 4"):
        pool_blocks(model, 4, 64, 16, torch.float32, memory=3 * per)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_reads_through_the_block_table(dtype):
    """Our C++ decode attention on a paged pool (blocks scattered, shuffled) equals the slot layout's."""
    hardware.require_kernels()
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, S, bs = 3, 4, 2, 16, 64, 16
    M = S // bs
    slots_k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    slots_v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    perm = torch.randperm(B * M, generator=g) + 1
    table = perm.view(B, M).contiguous()
    pool_k = torch.zeros(B * M + 1, Hkv, bs, D, dtype=dtype)
    pool_v = torch.zeros_like(pool_k)
    for b in range(B):
        for j in range(M):
            pool_k[table[b, j]] = slots_k[b, :, j * bs : (j + 1) * bs]
            pool_v[table[b, j]] = slots_v[b, :, j * bs : (j + 1) * bs]
    q = torch.randn(B, H * D, generator=g).to(dtype)
    k = torch.randn(B, Hkv * D, generator=g).to(dtype)
    v = torch.randn(B, Hkv * D, generator=g).to(dtype)
    pos = torch.tensor([5, 40, 17])
    cos, sin = torch.randn(B, D // 2, generator=g), torch.randn(B, D // 2, generator=g)
    want = cpu.decode_attention(q, k, v, cos, sin, slots_k, slots_v, None, pos, S)
    got = cpu.decode_attention(q, k, v, cos, sin, pool_k, pool_v, None, pos, S, table=table)
    assert torch.equal(got, want)
    for b in range(B):  # the new keys/values landed in each row's block
        p = int(pos[b])
        assert torch.equal(pool_k[table[b, p // bs], :, p % bs], slots_k[b, :, p])
        assert torch.equal(pool_v[table[b, p // bs], :, p % bs], slots_v[b, :, p])
    # the torch path's gather reads the same keys
    keys, values = paged.read(pool_k, pool_v, table, S)
    assert torch.equal(keys, slots_k) and torch.equal(values, slots_v)
    bad = table.clone()
    bad[0, 0] = B * M + 1
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu.decode_attention(q, k, v, cos, sin, pool_k, pool_v, None, pos, S, table=bad)


def test_model_on_a_scattered_table_equals_the_slot_layout():
    """Prefill and decode (eager, torch paths and our kernels) through shuffled block tables give the logits of
    the rows' home layout."""
    model = random_model(seed=1, max_batch=2, max_seq=64)
    KVCache(model, 2, 64)
    toks = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    want = [model(toks, 0), model(torch.tensor([[3], [4]]), 20)]
    cache = KVCache(model, 2, 64)
    with cache.manage():
        cache.set_blocks([0, 1], [[7, 2], [5, 8]])
        got = [model(toks, 0), model(torch.tensor([[3], [4]]), 20)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert cache.table[0, 2] == SCRATCH  # unallocated entries name the scratch block


def test_a_direct_call_rests_the_table_in_its_slot_layout_and_forgets_prefix_keys():
    """The block table's state is the cache's BlockTable, held by every layer (Attention.blocks), not a method
    attached to the tensor: a pass outside the runner puts the slot layout back and forgets every prefix key; the
    runner's next pass gets its own tables back."""
    model = random_model(seed=1, max_batch=2, max_seq=64)
    cache = KVCache(model, 2, 64, num_blocks=6, prefix_cache="exact", replicated=True)
    assert cache.pool.mode == "exact" and cache.replicated
    assert all(layer.attention.blocks is cache.blocks for layer in model.layers)
    assert cache.blocks.tensor is cache.table is model.layers[0].attention.block_table
    assert not hasattr(cache.table, "direct")
    home = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])  # blocks past the pool's 6 name the scratch block
    assert torch.equal(cache.table, home)
    with cache.manage():
        cache.set_blocks([0, 1], [[4], [2, 3]])
        cache.pool.publish(list(range(16)), cache.pool.allocate(1))
        model(torch.tensor([[3]]), 0)  # inside the runner's passes its tables stay
        assert cache.table[0, 0] == 4 and cache.pool.by_key
    model(torch.tensor([[3]]), 0)
    assert torch.equal(cache.table, home) and not cache.pool.by_key
    with cache.manage():
        assert cache.table[0, 0] == 4 and cache.table[1, 1] == 3


def test_pool_mode_is_declared_and_checked():
    assert BlockPool(4, 16).mode == "on" and BlockPool(4, 16, mode="off").mode == "off"
    with pytest.raises(ValueError, match="prefix_cache mode must be one of"):
        BlockPool(4, 16, mode=True)


def test_an_int8_pools_scales_are_the_layers_buffers():
    """An int8 pool's scales are declared buffers of each attention layer beside the codes (nothing attached to the
    cache tensors); a float pool allocated after it has none, and paged's reads refuse an int8 pool without them."""
    model = random_model(seed=1, max_batch=2, max_seq=64)
    cache = KVCache(model, 2, 64, dtype=torch.int8)
    attn = model.layers[0].attention
    assert attn.cache_k_scales.shape == (*attn.cache_k.shape[:-1], 1) and attn.cache_k_scales.dtype == torch.float16
    assert not hasattr(attn.cache_k, "scales") and "cache_v_scales" in dict(attn.named_buffers())
    model(torch.tensor([[3, 4]]), 0)
    assert attn.cache_k_scales.abs().sum() > 0
    assert len(cache._tensors()) == 4 * len(model.layers)
    with pytest.raises(ValueError, match="int8 KV pool needs its scales"):
        paged.read(attn.cache_k, attn.cache_v, cache.table[:1], 2)
    KVCache(model, 2, 64)
    assert attn.cache_k_scales is None and attn.cache_v_scales is None and attn.kv_scales() is None


def test_a_kept_row_lends_its_blocks_and_copies_only_the_partial_one():
    model = random_model(seed=1, max_batch=2, max_seq=64)
    cache = KVCache(model, 2, 64)
    k = cache.layers[0].cache_k
    with cache.manage():
        cache.set_blocks([0, 1], [[3, 1], [3, 4]])  # row 1 shares row 0's full block 3
        model(torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2)), 0)
        assert cache.keep(0, 20) == [3, 1] and cache.pool.used() == 2 and 3 not in cache.pool.free
        with pytest.raises(RuntimeError, match="no longer the row's own"):
            cache.keep(1, 40)  # its third entry is the scratch block
        full = k[3].clone()
        k[4].fill_(7.0)
        cache.continue_prefix([3, 1], 1, 20)
        assert torch.equal(k[4], k[1]) and torch.equal(k[3], full)
        cache.copy_rows([1], [0], 20)
        cache.copy_blocks([3], [5])
        assert torch.equal(cache.layers[0].cache_k[5], cache.layers[0].cache_k[3])


def test_int8_kv_cache_is_close_to_the_float_cache_and_half_its_size():
    """kv_cache_dtype="int8": codes and a scale per group of a position's head (q8_0); logits within a small error
    of the fp32 cache's on stories260K, greedy text alike, and about half the bytes of bf16 per block."""
    from conftest import STORIES, need

    from llama import Llama

    d = str(need(STORIES))
    ref = Llama.build(d, d + "/tokenizer.model", max_seq_len=128, max_batch_size=2, prefix_cache="off")
    q8 = Llama.build(d, d + "/tokenizer.model", max_seq_len=128, max_batch_size=2, kv_cache_dtype="int8")
    assert q8.cache.dtype == torch.int8
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    want, got = ref.score([text])[0], q8.score([text])[0]
    err = max(abs(a - b) for a, b in zip(want["logprobs"], got["logprobs"]))
    assert 0 < err < 0.05, err  # quantized (not equal), yet close
    opts = dict(temperature=0.0, max_gen_len=32)
    prompts = ["Once upon a time", "The little dog"]
    first = [r["generation"] for r in q8.text_completion(prompts, **opts)]
    want = [r["generation"] for r in ref.text_completion(prompts, **opts)]
    assert [t[:20] for t in first] == [t[:20] for t in want]  # (a 260K model drifts a few words on)
    assert [r["generation"] for r in q8.text_completion(prompts, **opts)] == first  # cached blocks: same text
    assert q8.cache.pool.stats["cached_tokens"] == 0  # (these prompts are under one block: nothing to share)
    a = q8.model.params  # codes plus an fp16 scale per group of 32 of a head, or per head under 32 (stories: 8)
    assert q8.cache.bytes == q8.cache.num_blocks * 2 * a.n_layers * 16 * a.n_kv_heads * (a.head_dim + 2)
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        Llama.build(d, d + "/tokenizer.model", max_seq_len=128, max_batch_size=2, kv_cache_dtype="int4")


def test_the_pre_grouping_module_path_still_works_and_warns():
    """llama.core.kv_cache was named in the docs before core/ was grouped by role: it keeps working, deprecated."""
    import importlib
    import sys

    from llama.core.worker import kv_cache

    sys.modules.pop("llama.core.kv_cache", None)
    with pytest.warns(DeprecationWarning, match=r"llama.core.worker.kv_cache"):
        old = importlib.import_module("llama.core.kv_cache")
    assert old.KVCache is kv_cache.KVCache and old.build_cache is kv_cache.build_cache
