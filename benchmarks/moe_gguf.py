"""A Qwen3-30B-A3B-shaped model of random weights written directly as a GGUF `qwen3moe` file (what moe.py times):
Q4_K_M as llama.cpp's quantizer types that model, or bf16, cut to its first N layers so it fits beside llama.cpp.

Quantized tensors are random blocks written tensor by tensor (never through a 61 GB bf16 file): random 4/6-bit
codes under fixed scales chosen so every weight is zero-mean with a standard deviation of about 0.02; bf16 tensors
are normal with that deviation; norms are ones and the router an fp32 normal (as llama.cpp's converter keeps it).
The vocabulary is Qwen2's (Qwen3 uses it) from llama.cpp's test vocabulary models/ggml-vocab-qwen2.gguf: 151,936
tokens, the real model's embedding rows, tokenizer gpt2 with pre-tokenizer qwen2.
"""

import importlib.util
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

STD = 0.02


@dataclass(frozen=True)
class MoEShape:
    """Qwen/Qwen3-30B-A3B's config.json by default (norm_topk_prob true: llama.cpp's qwen3moe always renormalises)."""

    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    n_experts: int = 128
    top_k: int = 8
    expert_dim: int = 768
    ffn_dim: int = 6144  # intermediate_size: in the config, unused by its MoE layers
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    context: int = 40960


QWEN3_30B_A3B = MoEShape()
SCHEMES = ("Q4_K_M", "BF16")


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's llama-quant.cpp: the layers whose attn_v and ffn_down Q4_K_M keeps at Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(shape: MoEShape, scheme: str, layers: int, vocab: int) -> List[Tuple[str, Tuple[int, ...], str]]:
    """(name, numpy shape (GGUF's dimensions reversed), type) of every tensor, in llama.cpp's order. Q4_K_M: Q4_K
    everywhere but output (Q6_K) and attn_v/ffn_down_exps on use_more_bits layers of the 48 (Q6_K), as llama.cpp's
    quantizer types the whole model (the cut keeps its first layers' types); norms and router F32."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    q4 = lambda more: "Q6_K" if scheme == "Q4_K_M" and more else ("Q4_K" if scheme == "Q4_K_M" else "BF16")  # noqa: E731
    d, hd, e, f = shape.dim, shape.head_dim, shape.n_experts, shape.expert_dim
    plan = [("token_embd.weight", (vocab, d), q4(False))]
    for i in range(layers):
        more = use_more_bits(i, shape.n_layers)
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (d,), "F32"),
                 (b + "attn_q.weight", (shape.n_heads * hd, d), q4(False)),
                 (b + "attn_k.weight", (shape.n_kv_heads * hd, d), q4(False)),
                 (b + "attn_v.weight", (shape.n_kv_heads * hd, d), q4(more)),
                 (b + "attn_output.weight", (d, shape.n_heads * hd), q4(False)),
                 (b + "attn_q_norm.weight", (hd,), "F32"),
                 (b + "attn_k_norm.weight", (hd,), "F32"),
                 (b + "ffn_norm.weight", (d,), "F32"),
                 (b + "ffn_gate_inp.weight", (e, d), "F32"),
                 (b + "ffn_gate_exps.weight", (e, f, d), q4(False)),
                 (b + "ffn_up_exps.weight", (e, f, d), q4(False)),
                 (b + "ffn_down_exps.weight", (e, d, f), q4(more))]
    plan += [("output_norm.weight", (d,), "F32"), ("output.weight", (vocab, d), q4(True))]
    return plan


def random_q4_k(blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_K super-blocks (144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes): every scale
    and min 8, dmin = 7.5 d, so a weight is d * 8 * (q - 7.5) for a random 4-bit q."""
    out = np.frombuffer(rng.bytes(blocks * 144), dtype=np.uint8).reshape(blocks, 144).copy()
    d = STD / (8 * 4.61)  # 4.61: the deviation of q - 7.5 over 0..15
    out[:, 0:4] = np.array([d, 7.5 * d], dtype=np.float16).view(np.uint8)
    out[:, 4:12] = 8  # scales and mins of sub-blocks 0-3
    out[:, 12:16] = 8 | (8 << 4)  # low nibbles: sub-blocks 4-7's scales, high: their mins
    return out


def random_q6_k(blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Q6_K super-blocks (210 bytes: 128 low and 64 high code bytes, 16 int8 scales, d): scales 8, a weight
    d * 8 * (q - 32) for a random 6-bit q."""
    out = np.frombuffer(rng.bytes(blocks * 210), dtype=np.uint8).reshape(blocks, 210).copy()
    out[:, 192:208] = 8
    out[:, 208:210] = np.array([STD / (8 * 18.5)], dtype=np.float16).view(np.uint8)  # 18.5: q - 32's deviation
    return out


def random_tensor(name: str, shape: Tuple[int, ...], qtype: str, rng: np.random.Generator) -> np.ndarray:
    """The tensor's bytes, (rows..., bytes a row) as uint8: the layout GGUFWriter takes for raw types."""
    import torch

    *rows, cols = shape
    n_rows = int(np.prod(rows)) if rows else 1
    if qtype == "F32":
        if name.endswith("norm.weight"):
            a = np.ones(shape, dtype=np.float32)
        else:
            a = rng.standard_normal(shape, dtype=np.float32) * STD
        return a.view(np.uint8).reshape(*rows, cols * 4)
    if qtype == "BF16":
        g = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
        t = torch.empty(n_rows, cols, dtype=torch.bfloat16).normal_(0, STD, generator=g)
        return t.view(torch.int16).numpy().view(np.uint8).reshape(*rows, cols * 2)
    blocks = n_rows * cols // 256
    a = random_q4_k(blocks, rng) if qtype == "Q4_K" else random_q6_k(blocks, rng)
    return a.reshape(*rows, -1)


def qwen2_vocab() -> Path:
    """llama.cpp's Qwen2 test vocabulary in the tree tests/peers.py unpacks (`python tests/peers.py`)."""
    spec = importlib.util.spec_from_file_location("_test_peers", Path(__file__).resolve().parents[1] / "tests" /
                                                  "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    path = peers.sdist_root() / "vendor" / "llama.cpp" / "models" / "ggml-vocab-qwen2.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `python tests/peers.py` once (it unpacks llama.cpp's tree)")
    return path


# GGUF value types: struct format of each scalar (8: string, 9: array); see gguf.GGUFValueType
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def vocab_fields(path: Path) -> Iterator[Tuple[str, object, object, Optional[object]]]:
    """(key, value, type, sub-type) of every tokenizer.* field of a vocabulary GGUF, parsed here: gguf's reader
    takes half a minute over Qwen2's 300,000 strings, this a second (strings kept as bytes, as written)."""
    import struct

    import gguf

    data = Path(path).read_bytes()
    pos = 0

    def take(fmt):
        nonlocal pos
        out = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return out[0]

    def string():
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n:pos]

    def value(kind):
        return string() if kind == 8 else take(SCALARS[kind])

    if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] != 3:
        raise ValueError(f"{path} is not a GGUF version 3 file")
    pos = 8
    take("Q")  # tensor count
    for _ in range(take("Q")):
        key, kind = string().decode(), take("I")
        if kind == 9:
            sub, count = take("I"), take("Q")
            val, sub = [value(sub) for _ in range(count)], gguf.GGUFValueType(sub)
        else:
            val, sub = value(kind), None
        if key.startswith("tokenizer."):
            yield key, val, gguf.GGUFValueType(kind), sub


def add_metadata(w, shape: MoEShape, scheme: str, layers: int) -> None:
    """The keys llama.cpp's converter writes for Qwen3-MoE (conversion/qwen.py), block_count the cut's."""
    import gguf

    w.add_name(f"random Qwen3-30B-A3B shape, {layers} of {shape.n_layers} layers, {scheme}")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(shape.ffn_dim)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.norm_eps)
    w.add_expert_count(shape.n_experts)
    w.add_expert_used_count(shape.top_k)
    w.add_expert_feed_forward_length(shape.expert_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if scheme == "Q4_K_M" else gguf.LlamaFileType.MOSTLY_BF16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_moe_gguf(path: Path, scheme: str = "Q4_K_M", layers: Optional[int] = None,
                   shape: MoEShape = QWEN3_30B_A3B, vocab: Optional[Path] = None, seed: int = 0) -> Path:
    """Write the file (to a .partial, renamed when whole) and return its path; an existing file is kept."""
    import gguf

    path = Path(path)
    if path.exists():
        return path
    layers = shape.n_layers if layers is None else layers
    if not isinstance(layers, int) or not 1 <= layers <= shape.n_layers:
        raise ValueError(f"layers must be an int in 1..{shape.n_layers}, got {layers!r}")
    for name in ("dim", "expert_dim"):
        if scheme == "Q4_K_M" and getattr(shape, name) % 256:
            raise ValueError(f"{name} ({getattr(shape, name)}) must be a multiple of 256 for K-quant blocks")
    fields = list(vocab_fields(vocab or qwen2_vocab()))
    n_vocab = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    plan = tensor_plan(shape, scheme, layers, n_vocab)
    tmp = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(tmp), "qwen3moe")
    add_metadata(w, shape, scheme, layers)
    for key, value, kind, sub in fields:
        w.add_key_value(key, value, kind, sub_type=sub)
    rng = np.random.default_rng(seed)
    sizes = {}
    for name, dims, qtype in plan:
        t = gguf.GGMLQuantizationType[qtype]
        block, size = gguf.GGML_QUANT_SIZES[t]
        sizes[name] = int(np.prod(dims)) // block * size
        w.add_tensor_info(name, (*dims[:-1], dims[-1] // block * size), np.dtype(np.uint8), sizes[name], raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    start = time.perf_counter()
    for name, dims, qtype in plan:
        w.write_tensor_data(random_tensor(name, dims, qtype, rng))
    w.close()
    tmp.rename(path)
    print(f"wrote {path} ({sum(sizes.values()) / 1e9:.2f} GB of tensors) in {time.perf_counter() - start:.0f} s",
          flush=True)
    return path


def tiny_shape(**changes) -> MoEShape:
    """A shape of the same kind small enough for a test: 2 layers, 8 experts of 256, dim 256."""
    return replace(MoEShape(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8, top_k=2,
                            expert_dim=256, ffn_dim=512, context=256), **changes)


def open_reader(source):
    """The package's GGUF reader of a path (llama/formats/gguf_file.py: gguf's reader, parsing arrays in one pass),
    or the reader given, so that callers asking several questions of one file open it once."""
    import gguf

    from llama.formats import gguf_file

    return source if isinstance(source, gguf.GGUFReader) else gguf_file.open_reader(Path(source))


def tensor_bytes(source) -> Dict[str, int]:
    """{tensor name: bytes} of a GGUF file (a path or an open reader)."""
    return {t.name: int(t.n_bytes) for t in open_reader(source).tensors}


def bytes_per_token(source, distinct_experts: float = None) -> dict:
    """What one token reads of the file (a path or an open reader; GB) and the parameters it uses (B), at batch 1
    (top_k experts a layer) or a step of several tokens touching `distinct_experts` experts a layer (the step's
    bytes, not divided)."""
    import gguf

    reader = open_reader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    n_experts = reader.fields[gguf.Keys.LLM.EXPERT_COUNT.format(arch=arch)].contents()
    used = reader.fields[gguf.Keys.LLM.EXPERT_USED_COUNT.format(arch=arch)].contents()
    used = used if distinct_experts is None else distinct_experts
    reads = params = 0.0
    for t in reader.tensors:
        share = used / n_experts if "_exps" in t.name else 1.0
        if t.name == "token_embd.weight":
            share = 1 / t.shape[-1]  # one row
        reads += share * int(t.n_bytes)
        params += share * int(t.n_elements)
    return {"read_gb": reads / 1e9, "params_b": params / 1e9}


def expected_distinct(batch: int) -> float:
    """Distinct experts a layer that `batch` tokens routed uniformly at random touch: n (1 - (1 - k/n)^batch)."""
    n, k = QWEN3_30B_A3B.n_experts, QWEN3_30B_A3B.top_k
    return n * (1 - (1 - k / n) ** batch)
