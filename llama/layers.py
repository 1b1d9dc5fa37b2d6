"""The model's parallel linear layers and embedding, the methods that multiply by their weights, and the fusing of
parallel projections (q/k/v, gate/up) into one product each, after loading.

A linear layer is built with a method (vLLM's LinearMethodBase): the unquantized dense product unless told
otherwise; quantization (llama/quantization/methods.py) replaces a layer's method and tensors when it quantizes,
and the method, never the tensors' shapes, says how the layer multiplies and whether it runs in our CPU kernels.

Fusing gives fewer, larger products per layer; checkpoints and tools still see Meta's names. Where the copy that
fusing makes would cost more than it gains (a large unquantized model on a CPU our kernels run) the loader skips it
(llama/loading/loader.py, fuses()).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.initialize import get_model_parallel_world_size
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from torch import nn

from llama.distributed.parallel import gather_last_dim, reduce_sum
from llama.kernels import cpu
from llama.kernels import dense, fused_decode

Route = Tuple[int, int, Tuple[torch.Tensor, ...]]  # fused_decode's (scheme, group size, tensors) for one product


class LinearMethod:
    """How a linear layer holds and multiplies its weight. The layer's tensors (weight, scales, packed,
    zero_points) are its own; the method says what they mean."""

    quantized = False
    concatenates = True  # fusing may concatenate layers' tensors along the output rows (fuse_columns)
    splits_state = True  # state_dict() may cut a fused layer's tensors back into Meta's layers
    # compile="auto" keeps small batches' decode steps eager for a model of such layers at any size: its eager step
    # is already one call into our kernels, which a compiled graph only wraps (llama/compilation/compiled_decode.py)
    eager_decode = False

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with the layer's local weight."""
        raise NotImplementedError

    def route(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> Optional[Route]:
        """What fused_decode's op takes for a product of `rows` rows of `dtype` when apply() would run it in our
        CPU kernel, else None (the same rule apply() follows)."""
        return None

    def in_our_kernels(self, layer: nn.Module) -> bool:
        """Whether every product of this layer runs in our CPU kernels on its own tensors (so a compiled step calls
        them instead of freezing a copy: llama/compilation/compiled_decode.py)."""
        return False

    def weight_tensor(self, layer: nn.Module) -> torch.Tensor:
        """The tensor holding the layer's weight (what a compiled graph may copy)."""
        return layer.weight

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class Unquantized(LinearMethod):
    """A bf16 or fp32 weight: llama/kernels/dense.py's product."""

    def apply(self, layer, x):
        return dense.linear(x, layer.weight)

    def route(self, layer, rows, dtype):
        return (fused_decode.FLOAT, 0, (layer.weight,)) if dense.ours(layer.weight, rows, dtype) else None

    def in_our_kernels(self, layer):
        return layer.weight.device.type == "cpu" and cpu.takes_float(layer.weight)


UNQUANTIZED = Unquantized()


class MethodLinear:
    """What the column- and row-parallel layers share: a method, and the tensors it multiplies."""

    def _init_tensors(self, weight_shape, method: Optional[LinearMethod]) -> None:
        self.weight = nn.Parameter(torch.empty(weight_shape))
        self.register_parameter("scales", None)  # a quantized method's scales
        self.register_buffer("packed", None, persistent=False)  # a prepacked weight (Int8DynamicOneDNN)
        self.register_buffer("zero_points", None, persistent=False)
        self.bias = self.master_weight = None
        self.method = UNQUANTIZED if method is None else method

    def take(self, method: LinearMethod, weight: Optional[torch.Tensor], scales: Optional[torch.Tensor] = None,
             packed: Optional[torch.Tensor] = None, zero_points: Optional[torch.Tensor] = None) -> None:
        """Hold these tensors, multiplied by `method` (how quantization replaces a layer's method)."""
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.scales = None if scales is None else nn.Parameter(scales, requires_grad=False)
        self.packed, self.zero_points = packed, zero_points
        self.method = method
        fused_decode.forget()  # the op's kept arguments name the old tensors


class ColumnLinear(MethodLinear, ColumnParallelLinear):
    """fairscale's column-parallel linear (output features split across ranks), with a bias where asked (Qwen2's
    q/k/v: each rank holds its rows' bias, added after the method's product, so any method takes it).

    Skips fairscale's master-weight initialisation: weights come from the checkpoint, so the layer can be built on
    the meta device and loaded with no second copy. The local product is the layer's method, so quantized weights
    work at any model-parallel size; with one rank there is no communication at all.
    """

    def __init__(self, in_features: int, out_features: int, gather_output: bool = False,
                 method: Optional[LinearMethod] = None, bias: bool = False):
        nn.Module.__init__(self)
        self.mp = get_model_parallel_world_size()
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self.output_size_per_partition = out_features // self.mp
        self._init_tensors((self.output_size_per_partition, in_features), method)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition))

    def forward(self, x):
        y = self.method.apply(self, x)  # fairscale's copy_to_model_parallel_region is the identity going forward
        if self.bias is not None:
            y = y + self.bias
        return gather_last_dim(y) if self.mp != 1 and self.gather_output else y


class RowLinear(MethodLinear, RowParallelLinear):
    """fairscale's row-parallel linear (input features split, outputs all-reduced), without bias."""

    def __init__(self, in_features: int, out_features: int, method: Optional[LinearMethod] = None):
        nn.Module.__init__(self)
        self.mp = get_model_parallel_world_size()
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, True
        self.input_size_per_partition = in_features // self.mp
        self._init_tensors((out_features, self.input_size_per_partition), method)

    def forward(self, x):
        y = self.method.apply(self, x)
        return y if self.mp == 1 else reduce_sum(y)


class Embedding(ParallelEmbedding):
    """fairscale's embedding split along the embedding dimension."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        nn.Module.__init__(self)
        self.mp = get_model_parallel_world_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = self.max_norm = self._weight = None
        self.norm_type, self.scale_grad_by_freq, self.sparse = 2.0, False, False
        self.embedding_dim_per_partition = embedding_dim // self.mp
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.embedding_dim_per_partition))

    def forward(self, tokens):
        y = F.embedding(tokens, self.weight)
        return y if self.mp == 1 else gather_last_dim(y)


def linear_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def kernel_model(model: nn.Module) -> bool:
    """Whether every linear layer runs in our CPU kernels (float_linear, int4 in its storage layout, int8-dynamic
    on plain int8 weights), so that a compiled step can call them on the model's own tensors."""
    return all(m.method.in_our_kernels(m) for m in linear_layers(model))


def float_kernel_model(model: nn.Module) -> bool:
    """Whether every linear layer is an unquantized CPU weight our float_linear takes (llama/kernels/cpu.py)."""
    return not quantized(model) and kernel_model(model)


def quantized(model: nn.Module) -> bool:
    """Whether any linear layer of model is quantized."""
    return any(m.method.quantized for m in linear_layers(model))


@torch.no_grad()
def fuse_columns(layers) -> nn.Module:
    """One column-parallel linear (ColumnLinear, the layers' own class) computing all of `layers` (same input) in one
    product, with their method.

    Each rank concatenates its own local shards, so under model parallel the fused layer is still column-parallel:
    rank r holds [q_r; k_r; v_r], exactly the rows of its local q, k and v.
    """
    method = layers[0].method
    if not method.concatenates or any(type(layer.method) is not type(method) for layer in layers):
        raise ValueError(f"cannot fuse layers held as {[layer.method for layer in layers]}: fuse before quantizing")
    biased = [layer.bias is not None for layer in layers]
    if any(biased) and not all(biased):
        raise ValueError("cannot fuse layers of which only some have a bias")
    with torch.device("meta"):
        fused = type(layers[0])(layers[0].in_features, sum(layer.out_features for layer in layers), bias=all(biased))
    scales = None if layers[0].scales is None else torch.cat([layer.scales for layer in layers])
    fused.take(method, torch.cat([layer.weight for layer in layers]), scales)
    if all(biased):
        fused.bias = nn.Parameter(torch.cat([layer.bias for layer in layers]), requires_grad=False)
    return fused


class Fusable(nn.Module):
    """A module whose parallel projections (`FUSED`: fused name -> Meta names) can be merged into one after loading.

    state_dict() still speaks Meta's names (the fused tensors are split back, as views), and load_state_dict()
    accepts them, so checkpoints and tools never see the fused layout.
    """

    FUSED: dict = {}
    _fuse_hooks = False  # the state-dict hooks that speak Meta's names, registered at the first fuse()

    def fuse(self) -> None:
        for fused_name, names in self.FUSED.items():
            if getattr(self, fused_name, None) is not None:
                continue
            setattr(self, fused_name, fuse_columns([getattr(self, n) for n in names]))
            for n in names:
                setattr(self, n, None)
        fused_decode.forget()
        if not self._fuse_hooks:
            self._register_state_dict_hook(_split_fused)
            self.register_load_state_dict_pre_hook(_join_fused)
            self._fuse_hooks = True

    @property
    def fused(self) -> bool:
        return any(getattr(self, name, None) is not None for name in self.FUSED)

    def split_sizes(self, fused_name: str):
        return [self.local_sizes[n] for n in self.FUSED[fused_name]]


def _split_fused(module, state_dict, prefix, local_metadata):
    for fused_name, names in module.FUSED.items():
        layer = getattr(module, fused_name, None)
        if layer is not None and not layer.method.splits_state:
            continue  # int4's packed layout cannot be cut into rows: kept fused (quant_checkpoint writes Meta names)
        for kind in ("weight", "scales", "bias"):
            key = f"{prefix}{fused_name}.{kind}"
            if key in state_dict:
                for name, part in zip(names, state_dict.pop(key).split(module.split_sizes(fused_name))):
                    state_dict[f"{prefix}{name}.{kind}"] = part


def _join_fused(module, state_dict, prefix, *args):
    if not module.fused:
        return
    for fused_name, names in module.FUSED.items():
        for kind in ("weight", "scales", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in names]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused_name}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])
