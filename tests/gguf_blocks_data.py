"""Random valid GGUF blocks of every block format (gguf 0.19 cannot quantize to K- or i-quants, so tests build the
bytes): random bytes are valid blocks once their fp16 scales are finite and small."""

import numpy as np
import torch

# ggml type name -> byte offsets of the block's fp16 fields (scales, and mins where the format has them)
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
               "IQ2_XXS": (0,), "IQ3_XXS": (0,)}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, std=None) -> np.ndarray:
    """(rows, row bytes) uint8: rows of `cols` values of GGUF type `kind`, random but valid; with std, the fp16
    scales (and mins) are shrunk so the dequantized values have about that standard deviation."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for offset in HALF_FIELDS[kind]:
        half = rng.uniform(0.002, 0.02, size=(rows, cols // values)).astype(np.float16)
        if offset == 0 and kind not in ("Q4_K", "Q5_K", "Q2_K"):
            half *= rng.choice(np.array([-1, 1], dtype=np.float16), size=half.shape)
        data[:, :, offset : offset + 2] = half.view(np.uint8).reshape(rows, -1, 2)
    if std is not None:
        factor = std / float(dequantized(data.reshape(rows, -1), kind).std())
        for offset in HALF_FIELDS[kind]:
            half = data[:, :, offset : offset + 2].copy().view(np.float16)
            data[:, :, offset : offset + 2] = (half.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def dequantized(blocks: np.ndarray, kind: str) -> torch.Tensor:
    """gguf's own numpy dequantization of these blocks, as fp32 (rows, cols)."""
    import gguf
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(blocks, gguf.GGMLQuantizationType[kind])))


def act_block(kind: str) -> int:
    """The activation block our kernels quantize x in for weights of this type: llama.cpp's Q8_0 or Q8_K."""
    return 256 if kind.endswith("_K") or kind == "IQ4_XS" else 32


def activation_codes(xb: torch.Tensor, block: int):
    """(codes, d, s) of fp32 activation blocks xb (..., block) as our kernels and llama.cpp's CPU backend make
    them. Blocks of 32 (its q8_0 / q8_1): d = amax / 127 rounded to fp16, codes round(x * (127 / amax)) half to even,
    s = (amax / 127) * (sum of codes) rounded to fp16. Blocks of 256 (its q8_K, quantize_row_q8_K_ref): max is the
    first element of the largest magnitude, iscale = -127 / max, codes round(iscale * x) half to even capped at 127,
    d = 1 / iscale; s unused (zero)."""
    def over(num, t):  # num / t as one fp32 division (torch's `127.0 / t` multiplies by t's reciprocal)
        return torch.full_like(t, num) / t

    if block == 32:
        amax = xb.abs().amax(-1, keepdim=True)
        codes = torch.round(xb * torch.where(amax > 0, over(127.0, amax), 0.0))
        d32 = amax / 127.0
        return codes, d32.half().float(), (d32 * codes.sum(-1, keepdim=True)).half().float()
    top = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))  # argmax: the first of equal magnitudes
    iscale = over(-127.0, torch.where(top != 0, top, 1.0))
    codes = torch.where(top != 0, torch.round(iscale * xb).clamp(max=127.0), 0.0)
    d = torch.where(top != 0, over(1.0, iscale), 0.0)
    return codes, d, torch.zeros_like(d)


def quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (M, K) as our kernels see it: int8 codes per block times their d (activation_codes), fp64."""
    codes, d, _ = activation_codes(x.float().reshape(x.shape[0], -1, block), block)
    return (codes.double() * d.double()).reshape(x.shape)


def reference_product(x: torch.Tensor, blocks: np.ndarray, kind: str) -> torch.Tensor:
    """x (M, K) times the blocks' weights as gguf dequantizes them, with our (llama.cpp's) int8 activations, fp64.
    Q4_1 and Q5_1 meet llama.cpp's q8_1: a block's min multiplies the fp16 sum s, not d x (the sum of codes)."""
    w = dequantized(blocks, kind).double()
    y = quantized_activations(x, act_block(kind)) @ w.T
    if kind in ("Q4_1", "Q5_1"):
        import gguf

        codes, d, s = activation_codes(x.float().reshape(x.shape[0], -1, 32), 32)
        nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
        mins = np.ascontiguousarray(blocks.reshape(blocks.shape[0], -1, nbytes)[:, :, 2:4]).view(np.float16)
        gap = s.double() - d.double() * codes.double().sum(-1, keepdim=True)
        y += gap.squeeze(-1) @ torch.from_numpy(mins.astype(np.float64)).squeeze(-1).T
    return y


# the formats gguf_linear_x16 (csrc/gguf_x16.cpp) decodes to int16 codes; the others run the fp32 path
X16_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q6_K")


def x16_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as gguf_linear_x16 sees it, fp64: per block of 32, codes round(x * (32767 / amax)) half to even (one
    fp32 division, one fp32 product) times amax / 32767 (one fp32 division)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767.0) / amax, 0.0)
    codes = torch.round(xb * inv).clamp(-32768, 32767)
    return (codes.double() * (amax / torch.full_like(amax, 32767.0)).double()).reshape(x.shape)


def x16_reference_product(x: torch.Tensor, blocks: np.ndarray, kind: str) -> torch.Tensor:
    """x (M, K) times the blocks' weights as gguf dequantizes them, in gguf_linear_x16's arithmetic, fp64: the int16
    activations (x16_activations) times the weights, offsets included."""
    return x16_activations(x) @ dequantized(blocks, kind).double().T


MATRICES = {"tok_embeddings.weight": "token_embd.weight", "output.weight": "output.weight",
            "attention.wq.weight": "attn_q.weight", "attention.wk.weight": "attn_k.weight",
            "attention.wv.weight": "attn_v.weight", "attention.wo.weight": "attn_output.weight",
            "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w2.weight": "ffn_down.weight",
            "feed_forward.w3.weight": "ffn_up.weight"}
# llama.cpp's Q4_K_M mixture, in little: Q6_K embedding/output, v and down projections, Q4_K elsewhere
Q4_K_M = {"tok_embeddings.weight": "Q6_K", "output.weight": "Q6_K", "attention.wv.weight": "Q6_K",
          "feed_forward.w2.weight": "Q6_K"}


def write_block_gguf(path, params: dict, sp_model_path, kinds, seed: int = 0, tied: bool = False, split: int = 0):
    """A random-weight llama GGUF (sentencepiece vocabulary from sp_model_path) whose matrices are random valid
    blocks: kinds(meta name) -> a GGUF type name (e.g. "Q4_K"), or a str for every matrix. Norms are F32."""
    import gguf
    import sentencepiece as spm
    from helpers import add_sentencepiece_vocab

    from llama.model import ModelArgs

    kind_of = (lambda name: kinds) if isinstance(kinds, str) else kinds
    args = ModelArgs.from_params(params)
    dim, hidden, hd = args.dim, args.hidden_dim, args.dim // args.n_heads
    kv = (args.n_kv_heads or args.n_heads) * hd
    shapes = {"tok_embeddings.weight": (args.vocab_size, dim), "output.weight": (args.vocab_size, dim),
              "attention.wq.weight": (dim, dim), "attention.wk.weight": (kv, dim), "attention.wv.weight": (kv, dim),
              "attention.wo.weight": (dim, dim), "feed_forward.w1.weight": (hidden, dim),
              "feed_forward.w2.weight": (dim, hidden), "feed_forward.w3.weight": (hidden, dim)}
    sp = spm.SentencePieceProcessor(model_file=str(sp_model_path))
    w = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split)  # split: files of at most that many tensors
    w.add_context_length(2048)
    w.add_embedding_length(dim)
    w.add_block_count(args.n_layers)
    w.add_feed_forward_length(hidden)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads or args.n_heads)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_rope_dimension_count(hd)
    add_sentencepiece_vocab(w, sp, unk=False)
    rng = np.random.default_rng(seed)

    def add(gname, meta, i):
        rows, cols = shapes[meta]
        kind = kind_of(meta)
        data = random_blocks(kind, rows, cols, seed=seed * 1000 + i, std=(1.0 if 'tok_emb' in meta else cols ** -0.5))
        w.add_tensor(gname, data, raw_dtype=gguf.GGMLQuantizationType[kind])

    count = 0
    for meta in ("tok_embeddings.weight", *(() if tied else ("output.weight",))):
        add(MATRICES[meta], meta, count)
        count += 1
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32))
    for layer in range(args.n_layers):
        for meta, gname in MATRICES.items():
            if not meta.startswith(("attention.", "feed_forward.")):
                continue
            add(f"blk.{layer}.{gname}", meta, count)
            count += 1
        for gname in ("attn_norm.weight", "ffn_norm.weight"):
            w.add_tensor(f"blk.{layer}.{gname}", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
