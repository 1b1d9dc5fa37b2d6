"""Every linear-layer method in one place (llama/layers.py LinearMethod): what a layer can be built with, or
given by quantization."""

from llama.layers import UNQUANTIZED, LinearMethod, Unquantized
from llama.quantization.gguf_blocks import GGUFBlocks
from llama.quantization.int4 import Int4
from llama.quantization.int4_cuda import Int4Cuda
from llama.quantization.int8 import Int8Dynamic, Int8DynamicOneDNN, Int8WeightOnly, int8_dynamic

__all__ = ["LinearMethod", "Unquantized", "UNQUANTIZED", "Int8WeightOnly", "Int8Dynamic", "Int8DynamicOneDNN",
           "int8_dynamic", "Int4", "Int4Cuda", "GGUFBlocks"]
