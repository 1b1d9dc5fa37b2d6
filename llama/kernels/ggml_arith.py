"""llama.cpp's CPU arithmetic around the block products, for models whose weights run as GGUF blocks.

Why: our block products already equal llama.cpp's bit for bit (q8 activations, its sums), but the ops between them
rounded otherwise (fp32 KV, torch's RoPE tables, SiLU and softmax), and with int8 activations a last-bit difference
anywhere moves an activation code and then the greedy ids. With this on, RMSNorm, RoPE, SwiGLU and attention
compute what llama.cpp's CPU graph computes (csrc/ggml_arith.cpp says which roundings, from llama.cpp's source):
keys, values, queries and softmax probabilities in fp16, its exp polynomial, its orders of summation. What it
follows is llama-cpp-python's `Llama` default, attention without flash attention (`flash_attn=False`), on an
AVX-512 build; llama.cpp's own CLI defaults to flash attention on CPU, which rounds otherwise.

The ops are a small library of their own (built like llama/kernels/cpu.py's: at install into the package, else
at first use into $LLAMA_CACHE/kernels/ggml/; llama/kernels/build.py), so the product kernels' library is
untouched. `enable(model)` turns the path on for one model (Transformer.use_ggml_arith sets its modules' declared
`ggml_arith`); every module keeps its fp32/bf16 arithmetic otherwise.
"""

import sys
from functools import lru_cache

import torch

from llama.kernels import build, cpu, ggml_products, invariant, paged

@lru_cache(maxsize=None)
def available() -> bool:
    """Whether the ops are loaded into torch.ops.llama_ggml and torch.ops.llama_ggml_mm (built the first time on this
    machine)."""
    if not cpu.available():
        return False
    cxx = cpu._compiler()
    try:
        out = build.packaged(build.GGML_ARITH, cxx) or build.locked_build(
            build.GGML_ARITH, cpu.cache_dir() / "kernels" / "ggml", cxx)
        torch.ops.load_library(str(out))
    except Exception as e:  # noqa: BLE001 - the model then keeps its own arithmetic
        print(f"note: llama.cpp's arithmetic is not available ({e.__class__.__name__}: {e})", file=sys.stderr)
        return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.cpp's RMSNorm times the weight: squares summed in double, fp32 input and result."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    return torch.ops.llama_ggml.rms_norm(rows, weight.float().contiguous(), float(eps)).view(x.shape)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """x (B, T, heads, dim) rotated in adjacent pairs at positions (B|1, T), as llama.cpp's rope (its normal mode)."""
    B, T, H, D = x.shape
    pos = positions.expand(B, T).reshape(-1).long()
    return torch.ops.llama_ggml.rope(x.reshape(B * T, H, D).float().contiguous(), pos, float(base)).view(B, T, H, D)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up as llama.cpp's swiglu computes it."""
    g, u = gate.reshape(-1, gate.shape[-1]).float(), up.reshape(-1, up.shape[-1]).float()
    return torch.ops.llama_ggml.swiglu(g, u).view(gate.shape)


def fp16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp16 (llama.cpp's KV cache), kept in x's dtype."""
    return x.to(torch.float16).to(x.dtype)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
           scale: float) -> torch.Tensor:
    """llama.cpp's attention without flash attention: q (B, T, heads, dim) over keys/values (B, kv_heads, S, dim)
    holding fp16 values, each query seeing positions 0..its own. A pass of more than one token sums its dots as
    llama.cpp's batched product does (tinyBLAS: llama.cpp fed a prompt in one batch), a pass of one as its
    one-token dot. While row-invariant arithmetic is on (prefix_cache="exact", llama/kernels/invariant.py) every
    token takes the one-token dot, so a position's result does not depend on how its prompt was chunked: llama.cpp
    fed one token at a time. Returns (B, T, heads * dim) fp32."""
    B, T = q.shape[:2]
    last = positions.expand(B, T).long()
    tiled = T > 1 and not invariant.active()
    return torch.ops.llama_ggml.attend(q.float().contiguous(), keys.float(), values.float(), last, tiled,
                                       float(scale))


def attention(attn, x: torch.Tensor, start, positions: torch.Tensor, rows, kv_len: int) -> torch.Tensor:
    """An Attention module's forward (llama/model.py) in llama.cpp's arithmetic: projections, RoPE, keys and values
    rounded to fp16 into the cache (the one cache write, Attention.store), attention over the cached positions."""
    B, T, _ = x.shape
    nq, nkv, hd = attn.n_local_heads, attn.n_local_kv_heads, attn.head_dim
    if attn.wqkv is None:
        q, k, v = attn.wq(x), attn.wk(x), attn.wv(x)
    else:
        qkv = attn.wqkv(x)
        q, k, v = qkv[..., : nq * hd], qkv[..., nq * hd : (nq + nkv) * hd], qkv[..., (nq + nkv) * hd :]
    theta = attn.args.rope_theta
    q = rope(q.reshape(B, T, nq, hd), positions, theta)
    k = fp16(rope(k.reshape(B, T, nkv, hd), positions, theta))
    attn.store(k, fp16(v.reshape(B, T, nkv, hd).float()), start, positions, rows)
    if attn.block_table is not None:
        if attn.blocks is not None:
            attn.blocks.direct()  # outside the runner: the slot layout (paged.BlockTable)
        keys, values = paged.read(attn.cache_k, attn.cache_v, attn.table_rows(rows, B, x.device), kv_len,
                                  torch.float32, scales=attn.kv_scales())
    else:
        ck, cv, idx = attn.cached_rows(rows)
        keys, values = (ck[:B, :, :kv_len], cv[:B, :, :kv_len]) if idx is None else \
            (ck[idx, :, :kv_len], cv[idx, :, :kv_len])
    scale = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(hd)).sqrt()  # 1.0f / sqrtf(head_dim)
    out = attend(q, keys, values, positions, scale.item())
    return attn.wo(out.to(x.dtype))


def feed_forward(ff, x: torch.Tensor) -> torch.Tensor:
    """A FeedForward module's forward in llama.cpp's arithmetic (its swiglu between the products)."""
    gate, up = ff.w13(x).chunk(2, dim=-1) if ff.w13 is not None else (ff.w1(x), ff.w3(x))
    return ff.w2(swiglu(gate, up).to(x.dtype))


def follows(args) -> bool:
    """Whether the architecture is one whose llama.cpp graph these ops reproduce: plain Llama attention and RoPE
    (no rotary scaling, window, biases, qk-norm, experts or Granite multipliers), head dim a multiple of 16."""
    return (not args.use_scaled_rope and not args.qk_norm and args.moe is None and args.rope_scaling is None and args.sliding_window is None
            and not args.qkv_bias and args.attention_multiplier is None and args.residual_multiplier == 1
            and args.embedding_multiplier == 1 and args.logits_scaling == 1 and args.head_dim % 16 == 0)


def enable(model) -> bool:
    """Turn llama.cpp's arithmetic on for model's norms, attention and FFNs, and its batched K-quant products
    (llama/kernels/ggml_products.py), where the architecture follows() and the model computes in fp32 on CPU;
    False (nothing changed) otherwise."""
    ref = model.norm.weight
    if not (follows(model.params) and ref.dtype == torch.float32 and ref.device.type == "cpu" and available()):
        return False
    model.use_ggml_arith()
    ggml_products.install(model)
    return True
