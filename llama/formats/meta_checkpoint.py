"""Reading and writing Meta-layout checkpoints: params.json, consolidated.XX.pth shards and checklist.chk.

A checkpoint saved as S shards loads at any model-parallel size W the head counts allow: every tensor is cut along
its parallel dimension (the reference can only load S == W). Shards are memory-mapped and loaded with
weights_only=True, so no pickled code runs and a rank only pages in the bytes of its own slice. Every shape is
checked against params.json and the other shards before any weight byte is read.
"""

import ctypes
import json
import mmap
import os
import pickle
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from llama.formats import libc
from llama.formats import llama4
from llama.formats.checklist import write_checklist
from llama.model import ModelArgs, check_model_parallel

DROPPED = ("rope.freqs",)  # Meta's shards carry the rotary table; the model recomputes it

# Dimension along which each tensor is split across model-parallel ranks (None: replicated on every rank).
GLOBAL_DIMS: Dict[str, Optional[int]] = {
    "tok_embeddings.weight": 1,  # ParallelEmbedding splits the embedding dimension
    "output.weight": 0,  # column parallel: output features (the vocabulary)
    "norm.weight": None,
}
LAYER_DIMS: Dict[str, Optional[int]] = {  # layers.N.<name>
    "attention.wq.weight": 0,  # column parallel: output features (whole heads per rank)
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wq.bias": 0,  # a bias goes with its rows (Qwen2)
    "attention.wk.bias": 0,
    "attention.wv.bias": 0,
    "attention.wo.weight": 1,  # row parallel: input features
    "feed_forward.w1.weight": 0,
    "feed_forward.w2.weight": 1,
    "feed_forward.w3.weight": 0,
    "attention_norm.weight": None,
    "ffn_norm.weight": None,
    "attention.q_norm.weight": None,  # Qwen3's qk-norm: one weight per head dimension, on every rank
    "attention.k_norm.weight": None,
    "feed_forward.gate.weight": None,  # an MoE layer's router, on every rank whole (llama/moe.py)
    "feed_forward.shared_expert.w1.weight": 0,  # Llama 4's shared expert: split as a dense FFN
    "feed_forward.shared_expert.w2.weight": 1,
    "feed_forward.shared_expert.w3.weight": 0,
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^feed_forward\.experts\.\d+\.(w[123]\.weight)$")  # each expert is split as a dense FFN


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object (params.json, config.json), or ValueError naming the file."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def read_params(ckpt_dir) -> dict:
    """params.json of a checkpoint directory, with clear errors for a missing directory or a bad file."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(ckpt_dir)!r} does not exist")
    path = ckpt_dir / "params.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a Meta-layout checkpoint needs params.json beside its *.pth")
    params = read_json_object(path)
    for key, what in UNSUPPORTED_PARAMS.items():
        if key in params:
            raise ValueError(f"{path} has {key!r}: {what}, which this Llama implementation cannot compute")
    if "moe_args" in params or "vision_args" in params:  # Llama 4: its text model, in our fields
        return llama4.meta_params(params, path)
    return params


# params.json keys of Meta checkpoints whose weights are not plain Llama matrices (other keys this architecture does
# not use are ignored with a warning by ModelArgs.from_params).
UNSUPPORTED_PARAMS = {
    "quantization_args": "a Llama 3.2 int4 (QLoRA / SpinQuant) checkpoint, packed 4-bit weights with their own scales",
    "lora_args": "a checkpoint with LoRA adapters to merge",
    "vision_chunk_size": "a Llama 3.2 Vision checkpoint (image encoder and cross-attention layers)",
}  # Llama 4's moe_args and vision_args: llama/formats/llama4.py (its text model loads; vision is skipped)


def shard_paths(ckpt_dir) -> List[Path]:
    """The consolidated.XX.pth shards in order (any *.pth when none is named that way)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(ckpt_dir)!r} does not exist")
    numbered = {}
    for p in ckpt_dir.glob("consolidated.*.pth"):
        m = re.fullmatch(r"consolidated\.(\d+)\.pth", p.name)
        if m:
            numbered[int(m.group(1))] = p
    if numbered:
        missing = sorted(set(range(max(numbered) + 1)) - set(numbered))
        if missing:
            raise FileNotFoundError(
                f"{ckpt_dir} has shards up to consolidated.{max(numbered):02d}.pth but consolidated."
                f"{missing[0]:02d}.pth is missing ({len(missing)} missing in all)"
            )
        return [numbered[i] for i in range(len(numbered))]
    paths = sorted(ckpt_dir.glob("*.pth"))
    if not paths:
        raise FileNotFoundError(f"no checkpoint files (*.pth) found in {ckpt_dir}")
    return paths


def load_shard(path: Path) -> Dict[str, torch.Tensor]:
    """Memory-map one shard with the weights-only unpickler; any failure is a ValueError naming the file."""
    return _load_shard(Path(path))[0]


def _load_shard(path: Path) -> Tuple[Dict[str, torch.Tensor], bool]:
    """(state dict, whether it is memory-mapped)."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    mapped = True
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            mapped = False  # pre-1.6 (non-zip) format: cannot be memory-mapped, read it whole
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(
            f"refusing to load {path}: it pickles objects other than tensors (possibly code), which the "
            f"weights-only loader rejects ({first})"
        ) from None
    except Exception as e:  # torch raises several types for truncated or corrupt files
        raise ValueError(
            f"cannot load checkpoint file {path} (truncated, corrupt or not a PyTorch checkpoint; "
            f"{os.path.getsize(path)} bytes): {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} does not hold a flat dict of tensors (got {type(state).__name__})")
    return state, mapped


def parallel_dim(name: str) -> Optional[int]:
    """The dimension `name` is split along across ranks (None: replicated)."""
    m = _LAYER.match(name)
    table, local = (LAYER_DIMS, m.group(2)) if m else (GLOBAL_DIMS, name)
    expert = _EXPERT.match(local) if m else None
    if expert:
        local = "feed_forward." + expert.group(1)
    if local not in table:
        raise ValueError(f"unknown tensor {name!r}: not a parameter of the Llama architecture")
    return table[local]


def expected_shapes(args: ModelArgs) -> Dict[str, Tuple[int, ...]]:
    """Full (unsharded) shape of every parameter the model needs, from params.json alone."""
    d, v, hd, hidden = args.dim, args.vocab_size, args.head_dim, args.hidden_dim
    shapes = {"tok_embeddings.weight": (v, d), "norm.weight": (d,), "output.weight": (v, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attention.wq.weight": (args.n_heads * hd, d),
            p + "attention.wk.weight": (args.n_kv_heads * hd, d),
            p + "attention.wv.weight": (args.n_kv_heads * hd, d),
            p + "attention.wo.weight": (d, args.n_heads * hd),
            p + "feed_forward.w1.weight": (hidden, d),
            p + "feed_forward.w2.weight": (d, hidden),
            p + "feed_forward.w3.weight": (hidden, d),
            p + "attention_norm.weight": (d,),
            p + "ffn_norm.weight": (d,),
        })
        if args.qk_norm:
            shapes.update({p + "attention.q_norm.weight": (hd,), p + "attention.k_norm.weight": (hd,)})
        if args.moe is not None and args.moe.is_moe(i):
            for w in ("w1", "w2", "w3"):
                del shapes[f"{p}feed_forward.{w}.weight"]
            shapes.update(moe_shapes(p, args))
        if args.qkv_bias:
            shapes.update({p + "attention.wq.bias": (args.n_heads * hd,), p + "attention.wk.bias": (args.n_kv_heads * hd,),
                           p + "attention.wv.bias": (args.n_kv_heads * hd,)})
    return shapes


def moe_shapes(prefix: str, args: ModelArgs) -> Dict[str, Tuple[int, ...]]:
    """An MoE layer's tensors in place of the dense FFN's: the router and each expert's three."""
    moe, d = args.moe, args.dim
    shapes = {f"{prefix}feed_forward.gate.weight": (moe.n_experts, d)}
    for e in [*range(moe.n_experts), *(["shared"] if moe.shared_expert else [])]:
        x = f"{prefix}feed_forward.experts.{e}." if e != "shared" else f"{prefix}feed_forward.shared_expert."
        shapes.update({x + "w1.weight": (moe.hidden_dim, d), x + "w2.weight": (d, moe.hidden_dim),
                       x + "w3.weight": (moe.hidden_dim, d)})
    return shapes


def check_shapes(shapes: Dict[str, Tuple[int, ...]], args: ModelArgs, source: str) -> None:
    """ValueError unless `shapes` (full tensor shapes) are exactly what params.json describes."""
    expected = expected_shapes(args)
    missing = [k for k in expected if k not in shapes and TIED.get(k) not in shapes]
    extra = [k for k in shapes if k not in expected]
    if missing:
        raise ValueError(
            f"{source} lacks {len(missing)} tensor(s) params.json needs (n_layers={args.n_layers}), "
            f"first {missing[0]!r}"
        )
    if extra:
        raise ValueError(
            f"{source} has {len(extra)} tensor(s) params.json does not describe (n_layers={args.n_layers}), "
            f"first {extra[0]!r}"
        )
    for name, want in expected.items():
        if name not in shapes:  # tied: checked through the tensor that stands in for it
            continue
        if tuple(shapes[name]) != want:
            raise ValueError(
                f"params.json is inconsistent with the weights: {name} in {source} has shape "
                f"{tuple(shapes[name])} but params.json (dim={args.dim}, n_heads={args.n_heads}, "
                f"n_kv_heads={args.n_kv_heads}, vocab_size={args.vocab_size}, FFN hidden dim={args.hidden_dim}) "
                f"implies {want}"
            )


def with_vocab(args: ModelArgs, vocab_size: int) -> ModelArgs:
    """args with vocab_size filled in when params.json leaves it to the tokenizer (-1)."""
    return replace(args, vocab_size=vocab_size) if args.vocab_size < 1 else args


# Tensors a checkpoint may leave out, and the tensor that stands in for them (tied embeddings, Llama 3.2 1B/3B).
TIED = {"output.weight": "tok_embeddings.weight"}


@dataclass
class ShardSet:
    """S memory-mapped shards of one checkpoint, validated against each other and params.json.

    source_dims: the dimension each tensor is split along in these files, where it differs from this model's
    (Meta's Llama 3 shards split tok_embeddings by vocabulary, Llama 2's by the embedding dimension). sources:
    names served by another file tensor (a tied output projection reads the embedding).
    """

    paths: List[Path]
    shards: List[Dict[str, torch.Tensor]]
    mapped: List[bool]
    args: ModelArgs
    source_dims: Dict[str, Optional[int]] = field(default_factory=dict)
    sources: Dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> List[str]:
        return list(self.shards[0]) + list(self.sources)

    def source_dim(self, name: str) -> Optional[int]:
        name = self.sources.get(name, name)
        return self.source_dims.get(name, parallel_dim(name))

    def full_shape(self, name: str) -> Tuple[int, ...]:
        shape, dim = list(self.shards[0][self.sources.get(name, name)].shape), self.source_dim(name)
        if dim is not None:
            shape[dim] *= len(self.shards)
        return tuple(shape)

    def slice(self, name: str, rank: int, world_size: int) -> torch.Tensor:
        """Rank `rank`'s part of `name` at model-parallel size world_size: the shard's own tensor when the
        layout already matches, else a fresh contiguous tensor holding only that slice."""
        parts = [s[self.sources.get(name, name)] for s in self.shards]
        S, dim, src = len(parts), parallel_dim(name), self.source_dim(name)
        if S == world_size and (S == 1 or src == dim):
            return parts[rank]
        if src != dim and S > 1:  # split another way in the files: assemble the whole tensor, then cut it
            full = _concat([(t, t, mapped) for t, mapped in zip(parts, self.mapped)], src)
            size = full.shape[dim] // world_size
            out = full if world_size == 1 else full.narrow(dim, rank * size, size).clone(
                memory_format=torch.contiguous_format)
        elif dim is None:
            out = parts[0].clone(memory_format=torch.contiguous_format)
        else:
            n = parts[0].shape[dim]
            size = n * S // world_size
            lo, hi = rank * size, (rank + 1) * size
            pieces = [
                (t, t.narrow(dim, max(lo, s * n) - s * n, min(hi, (s + 1) * n) - max(lo, s * n)), mapped)
                for s, (t, mapped) in enumerate(zip(parts, self.mapped))
                if max(lo, s * n) < min(hi, (s + 1) * n)
            ]
            out = _concat(pieces, dim)
        for t, mapped in zip(parts, self.mapped):
            if mapped:
                _release(t)  # the source pages were only needed for this copy
        return out


def _concat(pieces, dim: int) -> torch.Tensor:
    """A fresh contiguous tensor of the pieces along dim, from (shard tensor, piece of it, memory-mapped) triples.
    Each shard's pages are released as soon as its piece is copied, so the peak is the result plus one shard
    rather than plus every shard (torch.cat would read them all first)."""
    shape = list(pieces[0][1].shape)
    shape[dim] = sum(piece.shape[dim] for _, piece, _ in pieces)
    out, at = torch.empty(shape, dtype=pieces[0][1].dtype), 0
    for t, piece, mapped in pieces:
        out.narrow(dim, at, piece.shape[dim]).copy_(piece)
        at += piece.shape[dim]
        if mapped:
            _release(t)
    return out


def open_shards(ckpt_dir, args: ModelArgs) -> ShardSet:
    """Memory-map every shard and check keys, dtypes and shapes; no weight data is read."""
    paths = shard_paths(ckpt_dir)
    shards, mapped = [], []
    for p in paths:
        state, is_mapped = _load_shard(p)
        for name in DROPPED:
            state.pop(name, None)
        if llama4.is_llama4(args):  # Meta's Llama 4 names and 3-D experts, as views in ours
            state = llama4.meta_shard(state, args, p)
        for name, t in state.items():
            try:
                parallel_dim(name)
            except ValueError:
                raise ValueError(f"{p} holds tensor {name!r}, which is not a parameter of the Llama architecture") from None
            if not t.is_floating_point() or t.element_size() < 2:
                raise ValueError(
                    f"{p} holds {name} as {t.dtype}: only float32/16 and bfloat16 weights load (Meta's FP8 "
                    "checkpoints need their fp8_scales_*.pt applied; download the BF16 variant instead)")
        shards.append(state)
        mapped.append(is_mapped)
    first, ref = paths[0], shards[0]
    for p, s in zip(paths[1:], shards[1:]):
        if set(s) != set(ref):
            diff = sorted(set(s) ^ set(ref))[0]
            raise ValueError(f"shards disagree: {diff!r} is in only one of {first.name} and {p.name}")
        for name, t in s.items():
            if t.shape != ref[name].shape or t.dtype != ref[name].dtype:
                raise ValueError(
                    f"shards disagree on {name}: {first.name} has {tuple(ref[name].shape)} {ref[name].dtype}, "
                    f"{p.name} has {tuple(t.shape)} {t.dtype}"
                )
    source_dims = {}
    if "tok_embeddings.weight" in ref and len(shards) > 1:
        rows, cols = ref["tok_embeddings.weight"].shape
        if cols == args.dim:  # whole embedding rows in every shard: split by vocabulary (Llama 3)
            source_dims["tok_embeddings.weight"] = 0
    if "tok_embeddings.weight" in ref:
        vocab = ref["tok_embeddings.weight"].shape[0] * (len(shards) if source_dims else 1)
        if args.vocab_size >= 1 and args.vocab_size != vocab:
            raise ValueError(
                f"vocab_size is {args.vocab_size} (params.json or tokenizer) but tok_embeddings.weight in "
                f"{first} has {vocab} rows"
            )
        args = with_vocab(args, vocab)
    sources = {name: src for name, src in TIED.items() if name not in ref and src in ref}
    sset = ShardSet(paths, shards, mapped, args, source_dims, sources)
    source = str(paths[0]) if len(paths) == 1 else f"{Path(ckpt_dir)} ({paths[0].name}..{paths[-1].name} merged)"
    check_shapes({name: sset.full_shape(name) for name in sset.names}, args, source)
    return sset


def load_state_dict(ckpt_dir, args: ModelArgs, rank: int = 0, world_size: int = 1) -> Dict[str, torch.Tensor]:
    """The state dict of model-parallel rank `rank` out of `world_size`, from a checkpoint of any shard count."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside model parallel size {world_size}")
    check_model_parallel(with_vocab(args, world_size), world_size)  # heads, dim, FFN: before any file is read
    sset = open_shards(ckpt_dir, args)
    check_model_parallel(sset.args, world_size)  # vocab_size may only be known from the weights
    state = {name: sset.slice(name, rank, world_size).contiguous() for name in sset.shards[0]}  # Llama 4: views
    for name, src in sset.sources.items():
        # Tied: at size 1 the whole table serves both (no copy, even when merged from several shards); above, the
        # output's vocabulary rows are another cut than the embedding's columns.
        state[name] = state[src] if world_size == 1 else sset.slice(name, rank, world_size)
    return state


# ---------------------------------------------------------------------------------------------------------------
# Writing


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A tensor torch.save writes as just its own bytes (a view would drag its whole storage along)."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def split_tensor(name: str, t: torch.Tensor, rank: int, shards: int) -> torch.Tensor:
    """Shard `rank` of a full tensor (replicated tensors are returned whole)."""
    dim = parallel_dim(name)
    if dim is None or shards == 1:
        return _compact(t)
    size = t.shape[dim] // shards
    return _compact(t.narrow(dim, rank * size, size))


def write_shards(out_dir, params: dict, shards: int, shard_fn: Callable[[int], Dict[str, torch.Tensor]],
                 extra_files: Optional[Dict[str, Path]] = None) -> List[Path]:
    """Write consolidated.00.pth .. from shard_fn(k), then params.json, extra_files ({name: source}) and
    checklist.chk covering them all.

    One shard is in memory at a time. Refuses a directory that already holds *.pth files, since stale shards of
    another count would be loaded with the new ones.
    """
    out_dir = Path(out_dir)
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shard count must be a positive integer, got {shards!r}")
    if out_dir.exists() and any(out_dir.glob("*.pth")):
        raise FileExistsError(f"{out_dir} already holds *.pth files: choose an empty output directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for k in range(shards):
        path = out_dir / f"consolidated.{k:02d}.pth"
        state = {name: _compact(t) for name, t in shard_fn(k).items()}
        tmp = path.with_suffix(".pth.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        written.append(path)
        del state
    params_path = out_dir / "params.json"
    params_path.write_text(json.dumps(params, sort_keys=True))
    written.append(params_path)
    for name, src in (extra_files or {}).items():
        dst = out_dir / name
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            while chunk := fi.read(1 << 20):
                fo.write(chunk)
        written.append(dst)
    write_checklist(out_dir, [p.name for p in written])
    return written


def save_checkpoint(state_dict_full: Dict[str, torch.Tensor], params: dict, out_dir, shards: int = 1,
                    extra_files: Optional[Dict[str, Path]] = None) -> List[Path]:
    """Split a full (unsharded) state dict into `shards` Meta-layout shards plus params.json and checklist.chk."""
    state = {k: v for k, v in state_dict_full.items() if k not in DROPPED}
    for name in state:
        parallel_dim(name)
    args = ModelArgs.from_params(params)
    if "tok_embeddings.weight" in state:
        args = with_vocab(args, state["tok_embeddings.weight"].shape[0])
    check_shapes({k: tuple(v.shape) for k, v in state.items()}, args, "the state dict")
    check_model_parallel(args, shards)
    return write_shards(out_dir, params, shards, lambda k: {n: split_tensor(n, t, k, shards) for n, t in state.items()},
                        extra_files)


# ---------------------------------------------------------------------------------------------------------------
# Page release: after copying a slice out of a memory-mapped shard, drop the source pages from this process so
# that peak RSS follows the slice, not the whole file. Only ever applied to read-only file mappings.

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_madvise = libc.function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))


def _release(t: torch.Tensor) -> None:
    if _madvise is None or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE  # whole pages inside the tensor only
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_DONTNEED)
