"""A GGUF file's quantized tensors kept in their own block formats (llama/quantization/gguf_blocks.py) instead of
dequantized at load: the model's layers hold the file's bytes (memory-mapped where a tensor is used whole, copied
where it is sliced for model parallel or fused), so loading a Q4_K_M file takes about the file's size in memory.

Used on CPU where our kernels are built and no quantize= scheme is asked for (quantize= on a quantized file
re-quantizes: its blocks are dequantized layer by layer and quantized to the scheme, as before). Tensors of types
our kernels do not run (the i-quants other than IQ4_NL/IQ4_XS, F16/F32 norms) are dequantized as gguf_file reads
them.
"""

import re
from typing import Dict, List, Optional

import torch

from llama import settings
from llama.formats import gguf_file, gguf_heads
from llama.formats.meta_checkpoint import parallel_dim, split_tensor
from llama.kernels import cpu
from llama.layers import UNQUANTIZED, Fusable
from llama.model import Transformer
from llama.quantization import gguf_blocks


def runs_natively(reader, quantize: Optional[str], device) -> bool:
    """Whether a load of this file keeps its quantized tensors as blocks: CPU, our kernels, no quantize=,
    LLAMA_GGUF_BLOCKS not off, and a tensor of a type they run."""
    return (quantize is None and torch.device(device).type == "cpu" and settings.get().gguf_blocks
            and cpu.available() and any(native_type(t) is not None for t in reader.tensors))


def activations() -> str:
    """The arithmetic of the blocks' products, read once per load: LLAMA_GGUF_ACTIVATIONS ("int16" by default,
    chosen by measured quality; "int8" is llama.cpp's), and always "int8" under LLAMA_GGML_ARITH, whose point is
    llama.cpp's logits bit for bit."""
    s = settings.get()
    return "int8" if s.ggml_arith else s.gguf_activations


def native_type(t) -> Optional[int]:
    qtype = int(t.tensor_type)
    return qtype if qtype in gguf_blocks.NAMES else None


def blocks(t) -> torch.Tensor:
    """Reader tensor t's bytes as (rows, row bytes) uint8, mapping the file (no copy)."""
    data = t.data
    return gguf_file.mapped_tensor(data, torch.uint8).view(-1, data.shape[-1])


FFN = re.compile(r"feed_forward\.(?:experts\.\d+\.)?w[123]\.weight$")  # a dense FFN's or an expert's
ATTENTION = {"attention.wq": "q", "attention.wk": "kv", "attention.wv": "kv", "attention.wo": "q"}  # + .weight/.bias


def ffn_bounds(tensors: List, path, hidden: int, world: int) -> List[int]:
    """Where a layer's FFN hidden units split between ranks (world + 1 bounds). Row-parallel blocks cannot be
    cut, so the split falls on w2's block boundaries: an even split where one does, else as even as whole blocks
    allow, the larger parts first (Llama 2 7B's 11008 inputs are 43 super-blocks: 22 and 21 over 2 ranks). w1 and
    w3 take the same rows, so each rank's gate/up outputs are exactly its w2 inputs and nothing else changes."""
    w2 = next((t for t in tensors if FFN.search(gguf_file.meta_name(t.name, path))
               and gguf_file.meta_name(t.name, path).endswith("w2.weight")), None)
    qtype = None if w2 is None else native_type(w2)
    values = 1 if qtype is None else cpu.GGUF_BLOCKS[qtype][0]
    count = hidden // values
    if count < world:
        raise ValueError(f"{path}: tensor {w2.name} ({w2.tensor_type.name}) has {hidden} inputs, {count} blocks of "
                         f"{values}: too few for model parallel size {world} (each rank needs a whole block)")
    base, extra = divmod(count, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + (base + (r < extra)) * values)
    return bounds


def uneven_part(name: str, rank: int, bounds, heads, head_dim: int):
    """(dim, slice) of rank's part where the FFN splits at `bounds` (ffn_bounds) or the heads at `heads`
    (gguf_heads.head_bounds), else None (an even split)."""
    if bounds is not None and FFN.search(name):
        return parallel_dim(name), slice(bounds[rank], bounds[rank + 1])
    base = name.rsplit(".", 1)[0]
    which = next((w for n, w in ATTENTION.items() if base.endswith(n)), None) if heads is not None else None
    return None if which is None else (parallel_dim(name), heads.rows(rank, which, head_dim))


def shard(name: str, t, b: torch.Tensor, rank: int, world: int, path, bounds=None, heads=None,
          head_dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s part of blocks b (Meta name `name`): whole output rows for column-parallel weights, whole
    blocks of every row for row-parallel ones; the FFN's between `bounds` (ffn_bounds), attention's at `heads`
    (gguf_heads.head_bounds) or else evenly (refused where the heads' inputs do not split into whole blocks)."""
    dim = parallel_dim(name)
    if dim is None or world == 1:
        return b
    values, nbytes = cpu.GGUF_BLOCKS[int(t.tensor_type)]
    part = uneven_part(name, rank, bounds, heads, head_dim)
    if part is not None:
        s = part[1]
        return b[s].clone() if dim == 0 else b[:, s.start // values * nbytes : s.stop // values * nbytes].contiguous()
    if dim == 0:
        rows = b.shape[0] // world
        return b[rank * rows : (rank + 1) * rows].clone()
    inputs = gguf_blocks.values_per_row(int(t.tensor_type), b.shape[1])
    if (inputs // world) % values:
        raise ValueError(f"{path}: tensor {t.name} ({t.tensor_type.name}) has {inputs} inputs in blocks of {values}: "
                         f"model parallel size {world} would give each rank {inputs / world:g} inputs, not whole "
                         "blocks (the attention heads split evenly: use another model parallel size, or "
                         "quantize= to re-quantize)")
    width = b.shape[1] // world
    return b[:, rank * width : (rank + 1) * width].contiguous()


def split_float(name: str, value: torch.Tensor, rank: int, world: int, bounds=None, heads=None,
                head_dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s part of a dequantized tensor: the FFN's between `bounds` (ffn_bounds), attention's at `heads`
    (gguf_heads.head_bounds), the rest evenly."""
    part = None if world == 1 else uneven_part(name, rank, bounds, heads, head_dim)
    if part is None:
        return split_tensor(name, value, rank, world)
    dim, s = part
    return (value[s] if dim == 0 else value[:, s]).contiguous()


def native_model(reader, path, args, rank: int, world: int, device, dtype: torch.dtype, fuse: bool,
                 model=None, layer_ids=None) -> Transformer:
    """This rank's model with the file's native-type tensors as blocks, layer by layer (gguf_file.layer_groups);
    pages of tensors that were dequantized, sliced or fused are released as each layer is done. `model` (on the
    meta device) and `layer_ids` give a pipeline stage (llama/distributed/pipeline.py): its layers, renumbered from
    0, and the embedding or output only where the stage has them."""
    from tqdm import tqdm

    globals_, layers, shapes = gguf_file.layer_groups(reader, path)
    if model is None:
        with torch.device("meta"):
            model = Transformer(args)
    layer_ids = range(args.n_layers) if layer_ids is None else layer_ids
    held = {"tok_embeddings.weight": model.tok_embeddings is not None, "output.weight": model.output is not None}
    keep = set()  # storages shared with the embedding table (a tied output): left as the file's blocks
    mine = [t for t in globals_ if held.get(gguf_file.meta_name(t.name, path), True)]
    load_tensors(model, mine, "", path, dtype, rank, world)
    if "output.weight" not in shapes and model.output is not None:
        tie_output(model, globals_, path, dtype, rank, world)
    if isinstance(model.tok_embeddings, gguf_blocks.BlockEmbedding):
        keep.add(model.tok_embeddings.weight.untyped_storage().data_ptr())
    for m in (model.output, model.norm):
        if m is not None:
            finish(m, dtype, fuse, keep)
    release_unused(reader, globals_, model)
    big = sum(int(t.n_bytes) for t in reader.tensors) > 1 << 30
    for local, i in enumerate(tqdm(layer_ids, desc=f"loading {path.name}", unit="layer", disable=not big)):
        tensors = layers.get(i, [])
        moe = args.moe is not None and args.moe.is_moe(i)
        bounds = ffn_bounds(tensors, path, args.moe.hidden_dim if moe else args.hidden_dim, world) if world > 1 \
            else None
        heads = gguf_heads.head_bounds(tensors, path, args, world, native_type)
        load_tensors(model.layers[local], tensors, f"layers.{i}.", path, dtype, rank, world, bounds, heads)
        if heads is not None:
            gguf_heads.set_local_heads(model.layers[local].attention, heads, rank)
        if bounds is not None:
            ffn = model.layers[local].feed_forward
            for ff in (ffn.experts if moe else [ffn]):  # every expert splits at the same bounds
                width = bounds[rank + 1] - bounds[rank]
                ff.local_sizes = {"w1": width, "w3": width}
                ff.w1.output_size_per_partition = ff.w3.output_size_per_partition = width
                ff.w2.input_size_per_partition = width
        finish(model.layers[local], dtype, fuse)
        release_unused(reader, tensors, model.layers[local])
    empty = [n for n, p in model.named_parameters() if p.is_meta]
    if empty:
        raise ValueError(f"{path}: the file lacks {', '.join(empty[:4])}")
    return model.eval()


def load_tensors(module, tensors: List, prefix: str, path, dtype, rank: int, world: int, bounds=None,
                 heads=None) -> None:
    """Put these reader tensors (Meta names starting with prefix) into module: native-type matrices as blocks,
    the rest dequantized or cast by gguf_file.read_tensors; the FFN's cut at `bounds` (ffn_bounds), attention's at
    `heads` (gguf_heads.head_bounds)."""
    hd = module.attention.head_dim if heads is not None else 0
    plain, state, acts = [], {}, activations()
    for t in tensors:
        name = gguf_file.meta_name(t.name, path)
        qtype = native_type(t)
        if qtype is None or parallel_dim(name) is None:
            plain.append(t)
            continue
        b = blocks(t)
        if name == "tok_embeddings.weight":
            module.tok_embeddings = gguf_blocks.BlockEmbedding(b, qtype, world)
        else:
            module.get_submodule(name[len(prefix) : -len(".weight")]).take(
                gguf_blocks.method(qtype, acts), shard(name, t, b, rank, world, path, bounds, heads, hd))
    for name, value in gguf_file.read_tensors(plain, path, dtype).items():
        part = split_float(name, value, rank, world, bounds, heads, hd)
        layer_name, kind = name[len(prefix):].rsplit(".", 1)
        layer = module.get_submodule(layer_name) if uneven_part(name, rank, bounds, heads, hd) else None
        if layer is not None and getattr(layer, kind).shape != part.shape:  # an uneven split (ffn_bounds, heads)
            if kind == "weight":
                layer.take(UNQUANTIZED, part)
            else:
                layer.bias = torch.nn.Parameter(part, requires_grad=False)
        else:
            state[name[len(prefix):]] = part
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"{path}: tensors {unexpected} do not belong to the model")


def tie_output(model, globals_, path, dtype, rank: int, world: int) -> None:
    """No output.weight: the output is the embedding table (blocks shared at world size 1, its rows cut above;
    on a last pipeline stage without the embedding, read from the file)."""
    t = next(t for t in globals_ if gguf_file.meta_name(t.name, path) == "tok_embeddings.weight")
    qtype = native_type(t)
    if qtype is not None:
        emb = model.tok_embeddings
        b = emb.weight.data if isinstance(emb, gguf_blocks.BlockEmbedding) else blocks(t)
        rows = b.shape[0] // world
        part = b if world == 1 else b[rank * rows : (rank + 1) * rows].clone()
        model.output.take(gguf_blocks.method(qtype, activations()), part)
        return
    full = gguf_file.read_tensors([t], path, dtype)["tok_embeddings.weight"]
    model.output.weight = torch.nn.Parameter(split_tensor("output.weight", full, rank, world), requires_grad=False)


def finish(module, dtype: torch.dtype, fuse: bool, keep=frozenset()) -> None:
    """Fuse q/k/v and gate/up where their types agree (a Q4_K_M file's Q6_K v stays apart from its Q4_K q and k),
    repack Q4_K blocks for our kernels (gguf_blocks.repack; not those in storages `keep`), and cast the floating
    tensors (norms, dequantized matrices) to dtype."""
    if fuse:
        for m in module.modules():
            if isinstance(m, Fusable) and not m.fused:
                kinds = {type(getattr(m, n).method) for names in m.FUSED.values() for n in names}
                if len(kinds) == 1:
                    m.fuse()
    for m in list(module.modules()):
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and not w.is_meta and w.untyped_storage().data_ptr() not in keep:
            gguf_blocks.repack(m)
    for m in module.modules():
        if not isinstance(m, gguf_blocks.BlockEmbedding):
            for name, p in m.named_parameters(recurse=False):
                if p.is_floating_point() and p.dtype != dtype and name != "scales":
                    setattr(m, name, torch.nn.Parameter(p.to(dtype), requires_grad=False))


def release_unused(reader, tensors: List, module) -> None:
    """Release the file pages of these tensors unless the module holds them as they are (mapped blocks, or
    in-place floats)."""
    held = {p.untyped_storage().data_ptr() for p in module.parameters() if not p.is_meta}
    gguf_file.release(reader, [t for t in tensors if t.data.ctypes.data not in held])


def summary(model) -> Dict[str, int]:
    """How many linear layers hold each block type (for notes and tests)."""
    counts: Dict[str, int] = {}
    for m in model.modules():
        method = getattr(m, "method", None)
        if isinstance(method, gguf_blocks.GGUFBlocks):
            counts[gguf_blocks.NAMES[method.qtype]] = counts.get(gguf_blocks.NAMES[method.qtype], 0) + 1
    return counts
