"""Where attention heads split between model-parallel ranks when a GGUF file's wo keeps its blocks
(llama/formats/gguf_heads.py): evenly where that ends on block boundaries, else on key/value-group boundaries that
do, the larger parts first; refused, naming the tensor, where none do. (The split loaded and run under torchrun:
tests/distributed/test_gguf_stages.py.)"""

from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest

from llama.formats import gguf_quants
from llama.formats.gguf_heads import HeadBounds, head_bounds
from llama.model import ModelArgs


def bounds(n_heads, n_kv_heads, head_dim, world, kind="Q4_K"):
    args = ModelArgs(dim=n_heads * head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=32)
    wo = SimpleNamespace(name="blk.0.attn_output.weight", tensor_type=gguf.GGMLQuantizationType[kind])
    return head_bounds([wo], Path("m.gguf"), args, world, gguf_quants.native_type)


def test_an_even_split_on_block_boundaries_stays_even():
    assert bounds(32, 32, 128, 2) is None  # Llama 2 7B: 2048 inputs a rank, 8 super-blocks
    assert bounds(12, 12, 64, 3) is None  # 256 a rank
    assert bounds(12, 6, 64, 2, kind="Q8_0") is None  # 384 a rank: 12 blocks of 32


def test_a_split_inside_a_block_moves_to_group_boundaries():
    # 12 heads of 64, 6 groups of 2: 6 heads a rank = 384 inputs, 1.5 super-blocks; 8 | 4 heads = 512 | 256
    assert bounds(12, 6, 64, 2) == HeadBounds(q=[0, 8, 12], kv=[0, 4, 6])
    # 20 heads of 64 (MHA) over 3: cuts every 4 heads, nearest to 6.7 and 13.3 heads
    assert bounds(20, 20, 64, 3) == HeadBounds(q=[0, 8, 12, 20], kv=[0, 8, 12, 20])
    assert bounds(12, 12, 64, 2) == HeadBounds(q=[0, 8, 12], kv=[0, 8, 12])  # a tie: the larger part first


def test_no_split_on_block_boundaries_is_refused_naming_the_tensor():
    # 12 heads of 64 in 4 groups of 3 (192 inputs a group): no group boundary inside wo's 3 super-blocks
    with pytest.raises(ValueError, match=r"blk\.0\.attn_output\.weight \(Q4_K\) has 768 inputs in blocks of 256.*"
                                         r"cannot be split between 2 model-parallel ranks"):
        bounds(12, 4, 64, 2)
    with pytest.raises(ValueError, match="between 4 model-parallel ranks"):
        bounds(8, 8, 64, 4)  # 512 inputs: one boundary for three cuts
