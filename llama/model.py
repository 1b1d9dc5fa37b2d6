"""The Llama transformer: Meta's reference architecture with a per-row KV cache.

Same parameter names and model-parallel layers (fairscale) as Meta's reference, so its checkpoints load unchanged.
Differences that matter: positions may differ per batch row (continuous batching, ragged prompts), the cache rows a
batch uses can be chosen (slots), and attention is PyTorch's SDPA with grouped-query heads left unexpanded.
"""

from typing import Optional, Union

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.initialize import get_model_parallel_world_size
from torch import nn

from llama.sizes import derive_ffn, ffn_hidden_dim  # noqa: F401 (Meta's path; formats import them here)
from llama.rope import apply_rotary_emb, precompute_freqs_cis, reshape_for_broadcast  # noqa: F401 (Meta's path)
from llama.rope import rope_tables, scale_rope_frequencies  # noqa: F401
from llama import rope
from llama.kernels import cpu
from llama.kernels import exact_attention, fused_decode, ggml_arith, ggml_products, invariant, paged
from llama.layers import ColumnLinear, Embedding, Fusable, RowLinear  # noqa: F401 (Meta's path for the layers)
from llama.model_args import ModelArgs, MoEArgs, check_model_parallel, positive  # noqa: F401 (Meta's path)
from llama.moe import MoEFeedForward


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.ggml_arith = False  # llama.cpp's arithmetic where true (Transformer.use_ggml_arith)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in fp32, round to the model dtype, then scale: the reference's order of operations.
        if self.ggml_arith:
            return ggml_arith.rms_norm(x, self.weight, self.eps)
        if cpu.norms(x, self.weight):
            return cpu.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) as the reference's complex multiply does.

    x: (B, T, H, D); cos/sin: (T, D/2) or (B, T, D/2). Real arithmetic, so Inductor can fuse it.
    """
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """torch.repeat_interleave(x, dim=2, repeats=n_rep) for x (B, T, kv_heads, head_dim), as Meta's."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=2)


class Attention(Fusable):
    FUSED = {"wqkv": ("wq", "wk", "wv")}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ggml_arith = False  # llama.cpp's arithmetic where true (Transformer.use_ggml_arith)
        mp = get_model_parallel_world_size()
        self.n_local_heads = args.n_heads // mp
        self.n_local_kv_heads = args.n_kv_heads // mp
        self.head_dim = hd = args.head_dim
        self.args = args
        self.wq = ColumnLinear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.wk = ColumnLinear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wv = ColumnLinear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wo = RowLinear(args.n_heads * hd, args.dim)
        self.wqkv: Optional[ColumnLinear] = None
        # Qwen3's qk-norm: each head of q and of k normalised (one weight per head dimension) before the rotation
        self.q_norm = RMSNorm(hd, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(hd, eps=args.norm_eps) if args.qk_norm else None
        self.local_sizes = {"wq": self.n_local_heads * hd, "wk": self.n_local_kv_heads * hd,
                            "wv": self.n_local_kv_heads * hd}
        # (max_batch, kv_heads, max_seq, head_dim), allocated by llama.core.worker.kv_cache.KVCache, and an int8 pool's scales
        # (llama/kernels/paged.py). Buffers, so torch.compile sees them as the model's mutable state, but not
        # persistent: they are never part of a checkpoint.
        for name in ("cache_k", "cache_v", "cache_k_scales", "cache_v_scales"):
            self.register_buffer(name, None, persistent=False)
        # A paged pool (llama/core/worker/kv_cache.py): cache_k/cache_v are (blocks, kv_heads, block_size, head_dim) and
        # this (rows, blocks per row) int64 table, shared by every layer, places row r's position p in block
        # block_table[r, p // block_size]. None: the caches are (rows, kv_heads, positions, head_dim) slots.
        self.register_buffer("block_table", None, persistent=False)
        self.blocks: Optional[paged.BlockTable] = None  # the table's layout (its tensor is block_table): direct()

    def kv_scales(self) -> paged.Scales:
        """An int8 pool's (keys' scales, values' scales), None for a float one."""
        return None if self.cache_k_scales is None else (self.cache_k_scales, self.cache_v_scales)

    def head_norms(self, q: torch.Tensor, k: torch.Tensor):
        """q and k (..., heads, head_dim) through the qk-norm, where the model has one."""
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def qkv(self, x, cos, sin):
        """Rotated queries and keys and the values, each (B, T, heads, head_dim)."""
        B, T, _ = x.shape
        nq, nkv, hd = self.n_local_heads, self.n_local_kv_heads, self.head_dim
        if self.wqkv is None:
            q, k = self.head_norms(self.wq(x).view(B, T, nq, hd), self.wk(x).view(B, T, nkv, hd))
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), self.wv(x).view(B, T, nkv, hd)
        qkv = self.wqkv(x)
        if self.q_norm is not None:
            q, k = self.head_norms(qkv[..., : nq * hd].view(B, T, nq, hd), qkv[..., nq * hd : (nq + nkv) * hd].view(
                B, T, nkv, hd))
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), qkv[..., (nq + nkv) * hd :].view(B, T, nkv, hd)
        qk = apply_rotary(qkv[..., : (nq + nkv) * hd].view(B, T, nq + nkv, hd), cos, sin)  # one rotation for both
        return qk[:, :, :nq], qk[:, :, nq:], qkv[..., (nq + nkv) * hd :].view(B, T, nkv, hd)

    def decode(self, x, cos, sin, positions, rows, kv_len):
        """One token per row in one call of our CPU kernel (llama/kernels/cpu.py): rotation, cache write and
        attention, as qkv(), store() and the attention below compute them. Returns (B * T, heads * head_dim): T > 1
        tokens per row go in as rows of their own (row-invariant prefill, llama/kernels/invariant.py)."""
        B, T = x.shape[:2]
        nq, nkv = self.n_local_heads * self.head_dim, self.n_local_kv_heads * self.head_dim
        if T > 1:
            cos, sin, positions, rows = paged.flat_rows(cos, sin, positions, rows, B, T)
        B = B * T
        if self.wqkv is None:
            q, k, v = self.wq(x).view(B, nq), self.wk(x).view(B, nkv), self.wv(x).view(B, nkv)
        else:
            qkv = self.wqkv(x).view(B, -1)
            q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
        if self.q_norm is not None:
            q, k = self.head_norms(q.view(B, -1, self.head_dim), k.view(B, -1, self.head_dim))
            q, k = q.reshape(B, nq), k.reshape(B, nkv)
        return cpu.decode_attention(q, k, v, cos, sin, self.cache_k, self.cache_v, rows, positions, kv_len,
                                            self.block_table, self.args.attention_multiplier, self.args.sliding_window)

    def cached_rows(self, rows):
        """(keys, values, rows): a slice of consecutive rows (an engine group's slots) is a view used in place."""
        if isinstance(rows, slice):
            return self.cache_k[rows], self.cache_v[rows], None
        return self.cache_k, self.cache_v, rows

    def table_rows(self, rows, B: int, device) -> torch.Tensor:
        """The block table's rows (B, blocks per row) of a pass's cache rows (a tensor, a slice, or None: 0..B-1)."""
        if rows is None or isinstance(rows, slice):
            return self.block_table[rows if rows is not None else slice(0, B)][:B]
        return self.block_table[rows.to(device)]

    def store(self, k, v, start, positions, rows) -> None:
        """Write new keys/values (B, T, heads, head_dim): the model's one cache write. Rows 0..B-1 that share
        positions start..start+T-1 take plain slices (no index tensors, the cheapest step); any other layout
        (per-row positions, chosen rows) is a scatter."""
        B, T = k.shape[:2]
        if self.block_table is not None:
            return paged.store(self.cache_k, self.cache_v, self.table_rows(rows, B, k.device), k, v, positions,
                               self.kv_scales())
        ck, cv, rows = self.cached_rows(rows)
        if rows is None and start is not None:
            ck[:B, :, start : start + T] = k.transpose(1, 2)
            cv[:B, :, start : start + T] = v.transpose(1, 2)
            return
        idx = (torch.arange(B, device=k.device) if rows is None else rows)[:, None]
        ck[idx, :, positions.expand(B, T)] = k.to(ck.dtype)
        cv[idx, :, positions.expand(B, T)] = v.to(cv.dtype)

    def sdpa(self, q, keys, values, mask):
        """SDPA of q (B, heads, T, head_dim) over keys and values (B, kv_heads, kv_len, head_dim) under mask."""
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.args.attention_multiplier,
                                              enable_gqa=self.n_local_kv_heads != self.n_local_heads)

    def forward(self, x, cos, sin, start, positions, rows, kv_len, mask):
        B, T, _ = x.shape
        if self.ggml_arith:
            return ggml_arith.attention(self, x, start, positions, rows, kv_len)
        if not torch.compiler.is_compiling() and self.blocks is not None:
            self.blocks.direct()  # outside the runner: the slot layout (llama/kernels/paged.py BlockTable)
        exact = invariant.active()  # our kernels apply the window and scale: "exact" takes them for any model
        if (T == 1 or exact) and self.cache_k is not None and cpu.attends(x, self.cache_k) \
                and (exact or self.args.kernel_attends(kv_len)):
            return self.wo(self.decode(x, cos, sin, positions, rows, kv_len).view(B, T, -1))
        q, k, v = self.qkv(x, cos, sin)
        return self.attend(q, k, v, start, positions, rows, kv_len, mask, exact)

    def attend(self, q, k, v, start, positions, rows, kv_len, mask, exact: bool):
        """Store the new keys and values (B, T, heads, head_dim), then attend the queries q over the cache under
        mask (SDPA; our kernel over an int8 pool while `exact`), and project: the block's attention output."""
        B, T = q.shape[:2]
        self.store(k, v, start, positions, rows)
        ck, cv, rows = self.cached_rows(rows) if self.block_table is None else (None, None, rows)
        if self.block_table is not None:
            table = self.table_rows(rows, B, q.device)
            if exact and exact_attention.takes(q, self.cache_k):
                out = exact_attention.attend(q, self.cache_k, self.cache_v, table, positions, kv_len,
                                             self.args.attention_multiplier, self.args.sliding_window, self.kv_scales())
                return self.wo(out.view(B, T, -1))
            keys, values, q = paged.attending(q, self.cache_k, self.cache_v, table, kv_len, self.kv_scales())
        elif rows is None:  # rows 0..B-1: read the cache in place
            keys, values = ck[:B, :, :kv_len], cv[:B, :, :kv_len]
        else:
            keys, values = ck[rows, :, :kv_len], cv[rows, :, :kv_len]
        if T == 1 and torch.compiler.is_compiling():
            out = paged.decode_attention(q, keys, values, mask, self.args.attention_multiplier)
        else:
            out = self.sdpa(q.transpose(1, 2), keys, values, mask)
        return self.wo(paged.from_stored(out.transpose(1, 2), self.cache_k).reshape(B, T, -1))


class IRoPEAttention(Attention):
    """Llama 4's attention (Meta's iRoPE) in layer layer_id, in Meta's order: a RoPE layer rotates q and k, then
    L2-normalises each head (qk_l2_norm: no weight, eps = norm_eps) and attends within its chunk (a query at p sees
    keys (p // C) * C .. p); a NoPE layer (every nope_layer_interval-th) neither rotates nor normalises, scales its
    queries by the temperature of their positions (attn_temperature_tuning) and attends causally over all keys.

    Each pass builds the masks from its positions, so chunks hold in a prefill, a decode step, a speculative
    verification (per-row positions), a prefix-cached suffix and the paged pool alike. Our CPU decode kernel and the
    one-call decode step take a fixed window only (and rotate before any norm), so these layers always run the
    masked SDPA path (ModelArgs.kernel_attends is false for them). Under prefix_cache="exact" each query attends
    alone over just the keys it sees, so its bits do not depend on the rest of the pass."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__(args)
        self.rotates = not args.is_nope(layer_id)
        self.chunk = args.attention_chunk_size if self.rotates else None
        self.l2 = args.qk_l2_norm and self.rotates
        self.tuned = args.attn_temperature_tuning and not self.rotates

    def projections(self, x):
        """q (B, T, heads, head_dim), k and v (B, T, kv_heads, head_dim): separate or fused products."""
        B, T, _ = x.shape
        nq, nkv, hd = self.n_local_heads, self.n_local_kv_heads, self.head_dim
        if self.wqkv is None:
            return self.wq(x).view(B, T, nq, hd), self.wk(x).view(B, T, nkv, hd), self.wv(x).view(B, T, nkv, hd)
        q, k, v = self.wqkv(x).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        return q.view(B, T, nq, hd), k.view(B, T, nkv, hd), v.view(B, T, nkv, hd)

    def forward(self, x, cos, sin, start, positions, rows, kv_len, mask):
        if not torch.compiler.is_compiling() and self.blocks is not None:
            self.blocks.direct()  # outside the runner: the slot layout (llama/kernels/paged.py BlockTable)
        q, k, v = self.projections(x)
        if self.rotates:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.l2:
            q, k = rope.l2_norm(q, self.args.norm_eps), rope.l2_norm(k, self.args.norm_eps)
        if self.tuned:
            q = (q * rope.temperature(positions, self.args.floor_scale, self.args.attn_scale)).to(q.dtype)
        if self.chunk is not None:
            mask = rope.chunk_mask(positions, kv_len, self.chunk)
        elif mask is None:
            mask = rope.causal_mask(positions, kv_len)
        return self.attend(q, k, v, start, positions, rows, kv_len, mask, False)

    def sdpa(self, q, keys, values, mask):
        """SDPA under the mask; while row-invariant arithmetic is on, one query at a time over just the keys it
        sees (a contiguous span), so its bits do not depend on the pass."""
        if not invariant.active():
            return super().sdpa(q, keys, values, mask)
        B, H, T, D = q.shape
        out = q.new_empty(B, H, T, D)
        for b in range(B):
            for t in range(T):
                seen = mask[b if mask.shape[0] > 1 else 0, 0, t].nonzero()
                lo, hi = int(seen[0]), int(seen[-1]) + 1
                out[b, :, t : t + 1] = super().sdpa(q[b : b + 1, :, t : t + 1], keys[b : b + 1, :, lo:hi].contiguous(),
                                                    values[b : b + 1, :, lo:hi].contiguous(), None)[0]
        return out


class FeedForward(Fusable):
    FUSED = {"w13": ("w1", "w3")}

    def __init__(self, dim: Union[ModelArgs, int], hidden_dim: Optional[int] = None, multiple_of: int = 256,
                 ffn_dim_multiplier: Optional[float] = None, *, width: Optional[int] = None):
        """FeedForward(args), Meta's FeedForward(dim, hidden_dim, multiple_of, ffn_dim_multiplier), or
        FeedForward(dim, width=hidden) for a hidden size taken as it is (an expert's)."""
        super().__init__()
        self.ggml_arith = False  # llama.cpp's arithmetic where true (Transformer.use_ggml_arith)
        if isinstance(dim, ModelArgs):
            dim, hidden = dim.dim, dim.hidden_dim
        elif width is not None:
            hidden = width
        else:
            hidden = ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier, hidden_dim)
        self.w1 = ColumnLinear(dim, hidden)
        self.w2 = RowLinear(hidden, dim)
        self.w3 = ColumnLinear(dim, hidden)
        self.w13: Optional[ColumnLinear] = None
        local = hidden // get_model_parallel_world_size()
        self.local_sizes = {"w1": local, "w3": local}

    def forward(self, x):
        if self.ggml_arith:
            return ggml_arith.feed_forward(self, x)
        if self.w13 is None:
            return self.w2(invariant.silu(self.w1(x)) * self.w3(x))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(invariant.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = IRoPEAttention(args, layer_id) if args.irope else Attention(args)
        moe = args.moe is not None and args.moe.is_moe(layer_id)
        self.feed_forward = MoEFeedForward(args, FeedForward) if moe else FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.residual_multiplier = args.residual_multiplier

    def forward(self, x, cos, sin, start, positions, rows, kv_len, mask):
        m = self.residual_multiplier
        a = self.attention(self.attention_norm(x), cos, sin, start, positions, rows, kv_len, mask)
        h = x + (a if m == 1 else a * m)
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if m == 1 else f * m)


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        if params.vocab_size < 1:
            raise ValueError(f"vocab_size must be set (got {params.vocab_size}); take it from the tokenizer")
        check_model_parallel(params, get_model_parallel_world_size())
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers
        self.tok_embeddings = Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, params) for i in range(params.n_layers))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = ColumnLinear(params.dim, params.vocab_size, gather_output=True)
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)

    def fuse(self) -> "Transformer":
        """Merge q/k/v and gate/up projections into one product each (fewer, larger GEMVs per layer).

        Call after loading the weights; state_dict()/load_state_dict() keep Meta's names.
        """
        for module in self.modules():
            if isinstance(module, Fusable):
                module.fuse()
        return self

    def use_ggml_arith(self) -> None:
        """Every norm, attention and FFN in llama.cpp's arithmetic (llama/kernels/ggml_arith.py enable() decides)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, FeedForward)):
                module.ggml_arith = True

    def setup_rope(self, max_seq_len: int, device=None) -> None:
        """Rotary tables for positions up to twice max_seq_len, like the reference (positions past it stay defined).

        The KV cache itself belongs to llama.core.worker.kv_cache.KVCache, which calls this when it allocates.
        """
        a = self.params
        scaling = None
        if a.use_scaled_rope:
            scaling = dict(factor=a.rope_scaling_factor, low_freq_factor=a.rope_low_freq_factor,
                           high_freq_factor=a.rope_high_freq_factor, original_context=a.rope_original_context)
        cos, sin = rope_tables(a.head_dim, max_seq_len * 2, a.rope_theta, scaling, a.rope_scaling, max_seq_len)
        device = device or self.norm.weight.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        fused_decode.forget()  # a new KV cache: the one-call step's kept arguments name the old one

    @property
    def max_seq_len(self) -> int:
        attn = self.layers[0].attention
        if attn.block_table is not None:  # a paged pool: a row's blocks
            return attn.block_table.shape[1] * attn.cache_k.shape[2]
        return attn.cache_k.shape[2]

    @property
    def max_batch_size(self) -> int:
        attn = self.layers[0].attention
        return (attn.cache_k if attn.block_table is None else attn.block_table).shape[0]

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: Union[int, torch.Tensor] = 0,
        rows: Optional[torch.Tensor] = None,
        logit_index: Optional[torch.Tensor] = None,
        kv_len: Optional[int] = None,
    ) -> torch.Tensor:
        """Logits (fp32) for tokens (B, T) placed at start_pos (an int, or one position per row): pure compute.

        rows: cache rows to use (default 0..B-1): a tensor, or a slice of consecutive rows. logit_index: one index per row into T; return only those
        logits, shape (B, 1, V). kv_len: how many cache positions attention reads (default: just enough).
        """
        layer_args = self.layer_inputs(tokens, start_pos, rows, kv_len)
        with ggml_products.sequence_tokens(ggml_products.row_tokens(logit_index) if self.norm.ggml_arith else None):
            return self.logits(self.run_layers(self.embed(tokens), *layer_args), logit_index)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings of tokens in the model's dtype (a quantized model's table may be narrower), times the
        embedding multiplier."""
        h = self.tok_embeddings(tokens).to(self.norm.weight.dtype)
        m = self.params.embedding_multiplier
        return h if m == 1 else h * m

    def run_layers(self, h, cos, sin, start, positions, rows, kv_len, mask) -> torch.Tensor:
        """Every layer over h (B, T, dim): one token per row on CPU in one call of our kernel where it takes every
        layer (llama/kernels/fused_decode.py; the same result), else layer by layer."""
        if h.shape[1] == 1 and self.params.kernel_decodes(kv_len) and not self.norm.ggml_arith:
            out = fused_decode.run(self.layers, h, cos, sin, positions, rows, kv_len)
            if out is not None:
                return out
        for layer in self.layers:
            h = layer(h, cos, sin, start, positions, rows, kv_len, mask)
        return h

    def layer_inputs(self, tokens: torch.Tensor, start_pos: Union[int, torch.Tensor], rows, kv_len):
        """What every layer of a forward pass takes besides h: (cos, sin, start, positions, rows, kv_len, mask)."""
        if self.rope_cos is None or self.layers[0].attention.cache_k is None:
            raise RuntimeError("allocate a KV cache (llama.core.worker.kv_cache.KVCache) before calling the model")
        T = tokens.shape[1]
        device = tokens.device
        steps = torch.arange(T, device=device)
        if isinstance(start_pos, int):
            start, positions, last = start_pos, (start_pos + steps)[None], start_pos + T  # (1, T)
        else:
            start, positions, last = None, start_pos.to(device)[:, None] + steps, None  # (B, T)
        if kv_len is None:
            kv_len = last if last is not None else int(positions.max()) + 1
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]

        if T == 1 and kv_len == last and self.params.kernel_attends(kv_len):
            mask = None  # a single query at the newest position sees every cached key
        else:
            key_pos = torch.arange(kv_len, device=device)[None, None, :]
            mask = self.params.mask_window(key_pos <= positions[:, :, None], key_pos, positions[:, :, None])
            mask = mask[:, None]  # (B|1, 1, T, kv_len)
        return cos, sin, start, positions, rows, kv_len, mask

    def logits(self, h: torch.Tensor, logit_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 logits of the last layer's output h (B, T, dim): every position, or one per row at logit_index."""
        if logit_index is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logit_index.to(h.device)][:, None]
        out = invariant.logits(self.output, self.norm(h))
        return (out if self.params.logits_scaling == 1 else out / self.params.logits_scaling).float()

    def decode_step(self, tokens: torch.Tensor, pos: torch.Tensor, rows: Optional[torch.Tensor] = None):
        """One token per row, with shapes that depend only on the batch size (gpt-fast's static decode step).

        tokens (B, 1), pos (B,) positions, rows (B,) cache rows or None for 0..B-1. Attention reads the whole
        max_seq_len cache under a mask instead of a position-dependent slice, so torch.compile traces one graph per
        batch size and Inductor can treat the weights as constants. Same logits as forward() (fp32, (B, 1, V)).
        """
        positions = pos[:, None]  # (B, 1)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        key_pos = torch.arange(self.max_seq_len, device=tokens.device)
        mask = self.params.mask_window(key_pos[None, :] <= pos[:, None], key_pos[None, :], pos[:, None])
        h = self.run_layers(self.embed(tokens), cos, sin, None, positions, rows, self.max_seq_len,
                            mask[:, None, None, :])  # (B, 1, 1, max_seq_len)
        return self.logits(h)
