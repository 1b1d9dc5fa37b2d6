"""Where a layer's attention heads split between model-parallel ranks when its GGUF blocks are kept (llama/formats/
gguf_quants.py): wo is row-parallel, and its blocks (256 values for the K-quants) cannot be cut, so each rank's
share of the heads must end on a block boundary.

Why: an even split of the heads does not always do that: 12 heads of 64 over 2 ranks give each 384 of wo's 768
inputs, 1.5 super-blocks. The heads then split unevenly, on whole key/value-head groups (a group's query heads
share its keys and values, so they stay on one rank) whose boundaries are block boundaries: 8 | 4 heads there.
Where no such split exists (too few boundaries for the ranks) the load is refused, naming the tensor and the sizes.
"""

from dataclasses import dataclass
from typing import List, Optional

from llama.formats import gguf_file
from llama.kernels import cpu
@dataclass(frozen=True)
class HeadBounds:
    """Per rank (world + 1 bounds each): query heads q[r] .. q[r + 1] and key/value heads kv[r] .. kv[r + 1]."""
    q: List[int]
    kv: List[int]

    def rows(self, rank: int, which: str, head_dim: int) -> slice:
        """wq's rows (which "q"; also wo's inputs) or wk's and wv's ("kv") on this rank."""
        b = self.q if which == "q" else self.kv
        return slice(b[rank] * head_dim, b[rank + 1] * head_dim)


def head_bounds(tensors: List, path, args, world: int, native_type) -> Optional[HeadBounds]:
    """The heads' split for this layer's tensors: None where the even split ends on wo's block boundaries (or wo is
    not kept as blocks), else the uneven split on group boundaries nearest the even one (the larger parts first)."""
    wo = next((t for t in tensors if gguf_file.meta_name(t.name, path).endswith(".attention.wo.weight")), None)
    qtype = None if wo is None else native_type(wo)
    if qtype is None or world == 1:
        return None
    values = cpu.GGUF_BLOCKS[qtype][0]
    hd, groups, rep = args.head_dim, args.n_kv_heads, args.n_heads // args.n_kv_heads
    if groups % world == 0 and (groups // world * rep * hd) % values == 0:
        return None  # the even split (what every other format does)
    cuts = [c for c in range(1, groups) if (c * rep * hd) % values == 0]  # group counts ending on a block boundary
    if len(cuts) < world - 1:
        raise ValueError(
            f"{path}: tensor {wo.name} ({wo.tensor_type.name}) has {args.n_heads * hd} inputs in blocks of {values}: "
            f"its {args.n_heads} heads of {hd} ({groups} key/value groups of {rep}) cannot be split between "
            f"{world} model-parallel ranks on block boundaries (only {len(cuts)} boundaries fall between groups); "
            "use a smaller model parallel size, or quantize= to re-quantize")
    chosen: List[int] = []
    at = 0  # the first cut still free
    for r in range(1, world):
        ideal = r * groups / world  # nearest to it, leaving a cut for each later rank; ties: the larger part first
        at = min(range(at, len(cuts) - (world - 1 - r)), key=lambda i: (abs(cuts[i] - ideal), -cuts[i]))
        chosen.append(cuts[at])
        at += 1
    kv = [0, *chosen, groups]
    return HeadBounds(q=[c * rep for c in kv], kv=kv)


def set_local_heads(attention, bounds: HeadBounds, rank: int) -> None:
    """The attention module's per-rank sizes for an uneven split (what Attention.__init__ sets for an even one)."""
    hd = attention.head_dim
    nq, nkv = bounds.q[rank + 1] - bounds.q[rank], bounds.kv[rank + 1] - bounds.kv[rank]
    attention.n_local_heads, attention.n_local_kv_heads = nq, nkv
    attention.local_sizes = {"wq": nq * hd, "wk": nkv * hd, "wv": nkv * hd}
    for name, width in attention.local_sizes.items():
        layer = getattr(attention, name)
        if layer is not None:
            layer.output_size_per_partition = width
    attention.wo.input_size_per_partition = nq * hd
