"""How `python -m llama.quantize` stores a scheme's linear weights, and how loading makes layers of them again: a
StoredLayout per storable scheme (QuantScheme.storage). The files around them (params.json's record, shards,
slicing across ranks, the pack cache) are llama/formats/quantized_checkpoint.py's, the same for every scheme.

Every linear layer is stored as `<name>.weight` and `<name>.scales`, cut across shards as the float weight is;
scales of one value per output row over the whole input (row_scales) are replicated where the weight is cut by
its inputs.
"""

from typing import Optional, Tuple

import torch

from llama.kernels import cpu
from llama.quantization.int4 import Int4, kernel_shapes, own_kernel, quantize_codes, set_int4
from llama.quantization.int8 import Int8WeightOnly, quantize_weight

Shapes = Tuple[Tuple[int, ...], Tuple[int, ...]]


class StoredLayout:
    """A stored scheme's tensors and how a layer holds them."""

    row_scales = False  # one scale per output row over the whole input (replicated where the weight is cut by inputs)
    values_per_byte = 1  # input values per byte of a stored weight row
    device_layout = False  # on a CUDA device, layers are made there from the stored tensors, in the device's layout

    def quantize(self, weight: torch.Tensor, group_size: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(N, K) float weight -> (stored weight, stored scales)."""
        raise NotImplementedError

    def shapes(self, n: int, k: int, group_size: Optional[int]) -> Shapes:
        """The stored (weight, scales) shapes of an (n, k) float weight."""
        raise NotImplementedError

    def as_stored(self, inputs: int) -> bool:
        """Whether a layer of this input size holds the stored layout as it is (memory-mapped, nothing repacked)."""
        return True

    def model_shapes(self, rows: int, inputs: int, group_size: Optional[int]) -> Shapes:
        """The shapes of what a (rows, inputs) layer holds in the model (the pack cache's, for repacked layers)."""
        return self.shapes(rows, inputs, group_size)

    def hold(self, layer, weight: torch.Tensor, scales: torch.Tensor, group_size: Optional[int]) -> None:
        """Make `layer` a layer of this scheme from its stored tensors."""
        raise NotImplementedError

    def hold_model(self, layer, weight: torch.Tensor, scales: torch.Tensor, rows: int, inputs: int,
                   group_size: Optional[int]) -> None:
        """Make `layer` a layer of this scheme from tensors already in the model's layout (model_shapes)."""
        self.hold(layer, weight, scales, group_size)

    def load_as(self, device) -> Optional[str]:
        """The scheme a stored checkpoint loads as on `device` when the caller names none (None: its own)."""
        return None


def fastest_int8(device) -> str:
    """The int8 scheme a stored int8 checkpoint loads as when the caller names none: "int8-dynamic" on a CPU where
    our kernels run (1.64x llama.cpp's q8_0 at 7B, against 0.8x weight-only: docs/performance.md), else "int8"
    (CUDA, or no AVX2 kernels: weight-only, as oneDNN's int8-dynamic is no faster there)."""
    return "int8-dynamic" if torch.device(device).type == "cpu" and cpu.available() else "int8"


class Int8Stored(StoredLayout):
    """int8 (N, K) codes and bf16 scales (N,), one per output row: the model's Int8WeightOnly layout."""

    row_scales = True

    def quantize(self, weight, group_size):
        return quantize_weight(weight)

    def shapes(self, n, k, group_size):
        return (n, k), (n,)

    def hold(self, layer, weight, scales, group_size):
        Int8WeightOnly().hold(layer, weight, scales)

    def load_as(self, device):
        return fastest_int8(device)


class Int4Stored(StoredLayout):
    """llama/quantization/int4.py's storage layout: uint8 codes (N, K/2), (scale, zero) pairs (N, ceil(K/G), 2);
    repacked for aten's kernel where ours does not take the input size, tinygemm's layout on a GPU."""

    values_per_byte = 2
    device_layout = True

    def quantize(self, weight, group_size):
        return quantize_codes(weight, group_size)

    def shapes(self, n, k, group_size):
        return (n, k // 2), (n, -(-k // group_size), 2)

    def as_stored(self, inputs):
        return own_kernel(inputs)

    def model_shapes(self, rows, inputs, group_size):
        return kernel_shapes(rows, inputs, group_size)

    def hold(self, layer, weight, scales, group_size):
        set_int4(layer, weight, scales, group_size)

    def hold_model(self, layer, weight, scales, rows, inputs, group_size):
        Int4(group_size, rows, own_kernel(inputs)).hold(layer, weight, scales)
