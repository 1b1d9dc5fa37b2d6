"""Quantized Meta-layout checkpoints: written once by `python -m llama.quantize`, loaded by Llama.build as they are.

Layout: params.json as the source's plus {"quantization": {"scheme": NAME, "group_size": G}} (G for a grouped
scheme only; NAME a storable scheme's: llama/quantization/registry.py, its storage layout in stored.py);
consolidated.XX.pth shards (torch.save, memory-mappable, weights-only loadable) holding for every linear layer
  - int8: `<name>.weight` int8 (N, K) and `<name>.scales` bf16 (N,), one scale per output row over the whole
    input (so a row-parallel shard keeps every row's scale: the scales are replicated, the weight is cut by columns);
  - int4: `<name>.weight` uint8 (N, K/2) codes and `<name>.scales` bf16 (N, ceil(K/G), 2) (scale, zero) pairs, the
    storage layout of llama/quantization/int4.py, cut along the same dimension as the float weight;
and the embedding and norms as in the source. output.weight is always written (a tied model's is quantized from
the embedding). checklist.chk covers every file. A checkpoint of S shards loads at any model-parallel size W whose
slices fall on whole rows / whole groups.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from llama.formats import meta_checkpoint
from llama.kernels import int4_pack_store as pack_cache
from llama.model import ModelArgs, Transformer, check_model_parallel
from llama.quantization import schemes
from llama.quantization.schemes import QuantScheme

PARAMS_KEY = "quantization"
STORED_SCHEMES = schemes.storable()  # the built-in storable schemes (schemes.storable() has those registered since)
LINEAR = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
          "feed_forward.w3")
# fused module -> the Meta layers it concatenates (model.Attention/FeedForward.FUSED)
FUSED = {"attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
         "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3")}


def is_linear(name: str) -> bool:
    """Whether `name` (a Meta parameter name) is a linear layer's weight."""
    m = meta_checkpoint._LAYER.match(name)
    return name == "output.weight" or (m is not None and m.group(2).removesuffix(".weight") in LINEAR
                                       and m.group(2).endswith(".weight"))


def stored_dim(name: str, scheme: QuantScheme) -> Optional[int]:
    """Dimension a stored tensor is cut along across ranks (None: replicated)."""
    if name.endswith(".scales"):
        dim = meta_checkpoint.parallel_dim(name[: -len(".scales")] + ".weight")
        return None if scheme.storage.row_scales and dim == 1 else dim
    return meta_checkpoint.parallel_dim(name)


def stored_scheme(ckpt_dir) -> Optional[dict]:
    """The {"scheme", "group_size"} a quantized checkpoint records in params.json, or None for a float one."""
    path = Path(ckpt_dir) / "params.json"
    if not path.is_file():
        return None
    params = meta_checkpoint.read_params(ckpt_dir)
    info = params.get(PARAMS_KEY)
    if info is None:
        return None
    if not isinstance(info, dict) or info.get("scheme") not in schemes.storable():
        raise ValueError(f"{path} has {PARAMS_KEY}={info!r}: expected {{'scheme': one of {schemes.storable()}, ...}}")
    scheme = schemes.get(info["scheme"])
    if scheme.group_size is not None:
        scheme.check_group_size(info.get("group_size"))
    return info


def check_request(ckpt_dir, stored: dict, quantize, group_size, device=None) -> Tuple[QuantScheme, Optional[int]]:
    """(scheme, group size) to load a quantized checkpoint with on `device`; ValueError if the caller asked for
    another (quantize: a scheme's name, a QuantScheme or None).

    A scheme may take another's stored weights (QuantScheme.stored_as): int8 weights also load as "int8-dynamic",
    as both schemes quantize weights alike (llama/quantization/int8.py). Asked for nothing, a checkpoint loads as
    its storage layout says (StoredLayout.load_as: int8 as the fastest int8 scheme the device runs, int8-dynamic on
    a CPU with our kernels); quantize="int8" keeps them weight-only."""
    held = schemes.get(stored["scheme"])
    scheme = schemes.lookup(quantize)
    if scheme is None:
        preferred = None if device is None else held.storage.load_as(device)
        scheme = schemes.get(preferred) if preferred is not None else held
        scheme = scheme if scheme.loads(held) else held  # a layout shared with a scheme not taking these codes
    if not scheme.loads(held):
        raise ValueError(f"{ckpt_dir} holds {held.name} weights (params.json {PARAMS_KEY}); quantize="
                         f"{scheme.name!r} cannot be applied to them: pass quantize=None or {held.name!r}")
    if scheme is not held:  # its own group size, if any, checked by the caller
        return scheme, group_size
    stored_group = stored.get("group_size") if held.group_size is not None else None
    if group_size is not None and group_size != stored_group:
        raise ValueError(f"{ckpt_dir} was quantized with group size {stored_group}, not group_size={group_size!r}")
    return held, stored_group


def quantize_tensor(name: str, weight: torch.Tensor, scheme: QuantScheme,
                    group_size: Optional[int]) -> Dict[str, torch.Tensor]:
    """{name: stored weight, <layer>.scales: stored scales} for one full-precision linear weight."""
    q, scales = scheme.storage.quantize(weight, group_size)
    return {name: q, name[: -len(".weight")] + ".scales": scales}


# --------------------------------------------------------------------------------------------------- loading
def _open(ckpt_dir):
    paths = meta_checkpoint.shard_paths(ckpt_dir)
    shards = [meta_checkpoint.load_shard(p) for p in paths]
    for p, s in zip(paths[1:], shards[1:]):
        if set(s) != set(shards[0]):
            diff = sorted(set(s) ^ set(shards[0]))[0]
            raise ValueError(f"shards disagree: {diff!r} is in only one of {paths[0].name} and {p.name}")
    return paths, shards


def _full_shape(name: str, parts, scheme: QuantScheme) -> Tuple[int, ...]:
    shape, dim = list(parts[0][name].shape), stored_dim(name, scheme)
    if dim is not None:
        shape[dim] *= len(parts)
    return tuple(shape)


def check_groups(name: str, k: int, parts: int, group_size: Optional[int], what: str) -> None:
    """ValueError when cutting a grouped scheme's row-parallel weight `name` (k inputs) into `parts` would cut its
    groups."""
    if group_size is not None and parts > 1 and meta_checkpoint.parallel_dim(name) == 1 and (k // parts) % group_size:
        raise ValueError(f"{name} has {k} inputs: {what}")


def _check_shapes(paths, shards, args: ModelArgs, scheme: QuantScheme, group_size: Optional[int],
                  world_size: int) -> None:
    expected = meta_checkpoint.expected_shapes(args)
    want = {}
    for name, shape in expected.items():
        if not is_linear(name):
            want[name] = shape
            continue
        n, k = shape
        want[name], want[name[: -len(".weight")] + ".scales"] = scheme.storage.shapes(n, k, group_size)
        check_groups(name, k, world_size, group_size, f"model parallel size {world_size} would cut its groups of "
                     f"{group_size}; use a size whose slices ({k}/size) are multiples of {group_size}")
    have = set(shards[0])
    if have != set(want):
        diff = sorted(have ^ set(want))[0]
        where = "lacks" if diff in want else "has unexpected"
        raise ValueError(f"{paths[0].parent} {where} tensor {diff!r} for a {scheme.name} checkpoint of params.json's "
                         "shape")
    for name, shape in want.items():
        if _full_shape(name, shards, scheme) != shape:
            raise ValueError(f"{name} in {paths[0].parent} has shape {_full_shape(name, shards, scheme)}; params.json "
                             f"and {scheme.name} imply {shape}")


def _slice(name: str, parts, rank: int, world_size: int, scheme: QuantScheme) -> torch.Tensor:
    """Rank `rank`'s part of a stored tensor at model-parallel size world_size."""
    tensors, dim = [p[name] for p in parts], stored_dim(name, scheme)
    if dim is None or (len(tensors) == world_size):
        return tensors[0] if dim is None else tensors[rank]
    full = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)
    size = full.shape[dim] // world_size
    return full.narrow(dim, rank * size, size).contiguous()


def load_model(ckpt_dir, args: ModelArgs, rank: int, world_size: int, stored: dict, device=None) -> Transformer:
    """The fused, quantized model of rank `rank` from a quantized checkpoint, nothing requantized: on the CPU, and
    int4 layers already in tinygemm's layout on a CUDA `device` (the caller moves the rest)."""
    scheme = schemes.get(stored["scheme"])
    group_size = None if scheme.group_size is None else stored.get("group_size") or scheme.group_size
    check_model_parallel(args, world_size)
    paths, shards = _open(ckpt_dir)
    _check_shapes(paths, shards, args, scheme, group_size, world_size)
    state = {name: _slice(name, shards, rank, world_size, scheme) for name in shards[0]}
    # The layers as the model holds them (fused; int4 in its kernel's layout), cached per machine: after the first
    # load nothing is concatenated or repacked, so the model memory-maps its weights (llama/kernels/int4_pack_store.py)
    path = pack_cache.cache_path(ckpt_dir, rank, world_size, group_size or 0)
    on_cuda = device is not None and torch.device(device).type == "cuda"
    packs = None if on_cuda else Packs(path, pack_cache.load(path) or {}, {})
    with torch.device("meta"):
        model = Transformer(args)
        model.fuse()
    for i, block in enumerate(model.layers):
        for local in LINEAR + tuple(FUSED):
            owner, attr = local.split(".")
            layer = getattr(getattr(block, owner), attr)
            if layer is None:
                continue
            names = [f"layers.{i}.{n}" for n in FUSED.get(local, (local,))]
            _assign(layer, f"layers.{i}.{local}", names, state, scheme, group_size, packs, device)
        for norm in ("attention_norm", "ffn_norm"):
            getattr(block, norm).weight = nn.Parameter(state.pop(f"layers.{i}.{norm}.weight"), requires_grad=False)
        if args.qkv_bias:  # kept in full precision, fused as the weights are
            biases = [state.pop(f"layers.{i}.attention.{n}.bias") for n in ("wq", "wk", "wv")]
            block.attention.wqkv.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    _assign(model.output, "output", ["output"], state, scheme, group_size, packs, device)
    if packs is not None and packs.fresh:
        pack_cache.save(packs.path, {**packs.cached, **packs.fresh})
    model.tok_embeddings.weight = nn.Parameter(state.pop("tok_embeddings.weight"), requires_grad=False)
    model.norm.weight = nn.Parameter(state.pop("norm.weight"), requires_grad=False)
    if state:
        raise ValueError(f"{ckpt_dir} holds tensors the model does not use: first {sorted(state)[0]!r}")
    return model


@dataclass
class Packs:
    """int4 layers in the kernel's layout: read from the machine's cache, and packed during this load."""

    path: Optional[Path]
    cached: Dict[str, torch.Tensor]
    fresh: Dict[str, torch.Tensor]

    def take(self, key: str, shapes):
        """The cached (weight, scales) of layer `key` if they have the shapes its stored tensors imply."""
        packed, scales = self.cached.get(key + ".packed"), self.cached.get(key + ".scales")
        if packed is None or scales is None or (tuple(packed.shape), tuple(scales.shape)) != shapes:
            return None
        return packed, scales


def _assign(layer, key: str, names, state, scheme: QuantScheme, group_size: Optional[int],
            packs: Optional[Packs] = None, device=None) -> None:
    weights = [state.pop(n + ".weight") for n in names]
    scales = [state.pop(n + ".scales") for n in names]
    layout = scheme.storage
    if layout.device_layout and device is not None and torch.device(device).type == "cuda":  # int4: tinygemm's
        layout.hold(layer, torch.cat(weights).to(device), torch.cat(scales).to(device), group_size)
        return
    rows, inputs = sum(w.shape[0] for w in weights), weights[0].shape[1] * layout.values_per_byte
    own = layout.as_stored(inputs)  # the stored layout is the model's (no repacking)
    # A single stored tensor in the model's layout is used as it is (memory-mapped); fused or repacked ones are cached
    cached = packs is not None and packs.path is not None and (len(names) > 1 or not own)
    if cached:
        hit = packs.take(key, layout.model_shapes(rows, inputs, group_size))
        if hit is not None:
            layout.hold_model(layer, *hit, rows, inputs, group_size)
            return
    weight = weights[0] if len(names) == 1 else torch.cat(weights)
    scale = scales[0] if len(names) == 1 else torch.cat(scales)
    layout.hold(layer, weight, scale, group_size)
    if cached:
        packs.fresh[key + ".packed"], packs.fresh[key + ".scales"] = layer.weight.data, layer.scales.data
