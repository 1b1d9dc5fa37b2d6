"""llama-models' `llama_models.llama4.datatypes` names, for code written against it: the inputs and outputs of
Meta's Llama 4 model (llama.llama4.model.Transformer) and generator (llama.llama4.generation.Llama4), with Meta's
fields. Images and image embeddings can be written here but are refused where they would be used: the Llama 4
image encoder is not implemented (llama/formats/llama4.py)."""

from dataclasses import dataclass
from typing import List, Optional, Union

import torch


@dataclass
class MaskedEmbedding:
    """Image embeddings (B, S, D) and the mask (B, S, 1) of the positions they replace."""

    embedding: torch.Tensor
    mask: torch.Tensor


@dataclass
class LLMInput:
    """A prompt as the generator takes it: its tokens (a list of ids, or a 1-D tensor) and images (refused)."""

    tokens: Union[List[int], torch.Tensor]
    images: Optional[List[torch.Tensor]] = None


@dataclass
class TransformerInput:
    """One forward pass: tokens (B, S) placed at tokens_position (an int, or one start per row), plus image
    embeddings (refused)."""

    tokens: torch.Tensor
    tokens_position: Union[torch.Tensor, int]
    image_embedding: Optional[MaskedEmbedding] = None


@dataclass
class LLMOutput:
    """The fp32 logits (B, S, vocab_size) of a pass."""

    logits: torch.Tensor


TransformerOutput = LLMOutput
