"""prefix_cache="exact" with quantized products (int8 weight-only, int8-dynamic, int4, GGUF blocks) and an int8 KV
cache: a position's logits and sampled tokens' logprobs are bitwise the same whether its prompt came from the cache,
from chunks of any size, or ran beside other rows, and a decode step's row is a prefill's (llama/kernels/invariant.py,
llama/kernels/exact_attention.py). compile=True is refused with it, before loading."""

import hardware
import numpy as np
import pytest
import torch
from conftest import STORIES, need
from gguf_blocks_data import Q4_K_M, random_blocks, write_block_gguf
from helpers import logprobs_in_any_company
from test_exact_invariance import OTHER, PROMPT, Rows

from llama.kernels import cpu
from llama.kernels import invariant
from llama.quantization import gguf_blocks
from llama.quantization.int4 import quantize_codes
from llama.quantization.int8 import quantize_weight, weight_only_linear

pytestmark = hardware.KERNELS


def build(path=None, **kw):
    from llama import Llama

    d = str(need(STORIES)) if path is None else str(path)
    tok = d + "/tokenizer.model" if path is None else None
    return Llama.build(d, tok, max_seq_len=256, max_batch_size=6, prefix_cache="exact", **kw)


def assert_rows_invariant(llm):
    """Test_exact_invariance's passes: whole, chunked, cached, beside a longer companion, and as a decode step."""
    rows, n = Rows(llm), len(PROMPT)
    rows.give(0)
    whole = rows.prefill([0], [PROMPT], [0])[0]
    rows.give(1)
    got, s = [], 0
    for c in (1, 16, 5, 1, 30, n):  # more than 32 rows only in the whole pass: where oneDNN's GEMM would take over
        chunk = PROMPT[s : s + c]
        if chunk:
            got.append(rows.prefill([1], [chunk], [s])[0])
            s += len(chunk)
    assert torch.equal(torch.cat(got), whole), "chunked"
    rows.give(2, shared=rows.blocks[0][:3])
    assert torch.equal(rows.prefill([2], [PROMPT[48:]], [48])[0], whole[48:]), "cached"
    rows.give(3)
    rows.give(4)
    both = rows.prefill([3, 4], [PROMPT[:40], OTHER[:90]], [0, 0])
    assert torch.equal(both[0, :40], whole[:40]), "batched"
    rows.give(5)
    rows.prefill([5], [PROMPT[:-1]], [0])
    assert torch.equal(rows.decode(5, PROMPT[-1], n - 1), whole[-1]), "decoded"


CONFIGS = [  # (quantize, dtype, kv_cache_dtype)
    ("int8-dynamic", "fp32", None), ("int8-dynamic", "bf16", "int8"), ("int4", "fp32", "int8"), ("int4", "bf16", None),
    ("int8", "fp32", "int8"), ("int8", "bf16", None), (None, "fp32", "int8"), (None, "bf16", "int8"),
]


@pytest.mark.parametrize("quantize,dtype,kv", CONFIGS)
def test_quantized_products_and_int8_kv_give_every_pass_the_same_rows(quantize, dtype, kv):
    assert_rows_invariant(build(quantize=quantize, dtype=dtype, kv_cache_dtype=kv))


@pytest.mark.parametrize("dtype,kv", [("fp32", None), ("bf16", "int8")])
def test_gguf_block_weights_give_every_pass_the_same_rows(dtype, kv, tmp_path):
    """A random Q4_K_M file (Q4_K and Q6_K blocks, dim 256): the block products in our kernels."""
    params = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 256, "norm_eps": 1e-5,
              "vocab_size": 512}
    path = write_block_gguf(tmp_path / "q4km.gguf", params, need(STORIES / "tokenizer.model"),
                            lambda name: Q4_K_M.get(name, "Q4_K"))
    llm = build(path, dtype=dtype, kv_cache_dtype=kv)
    assert isinstance(llm.model.layers[0].attention.wo.method, gguf_blocks.GGUFBlocks)
    assert_rows_invariant(llm)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gemm_tiles_give_every_pass_the_same_rows(dtype, tmp_path, monkeypatch):
    """A random model whose products are large enough for oneDNN's GEMM tiles (llama/kernels/tiled.py; stories260K's
    stay in our kernel)."""
    from llama.hub.demo import write_random_checkpoint
    from llama.kernels import tiled

    params = {"dim": 512, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "multiple_of": 256, "norm_eps": 1e-5,
              "vocab_size": 512}
    ckpt = write_random_checkpoint(tmp_path / "m", params, tokenizer_path=need(STORIES / "tokenizer.model"))
    calls = []
    gemm = tiled._gemm
    monkeypatch.setattr(tiled, "_gemm", lambda rows, w: calls.append(rows.shape[0]) or gemm(rows, w))
    from llama import Llama

    llm = Llama.build(str(ckpt), str(ckpt / "tokenizer.model"), max_seq_len=256, max_batch_size=6,
                      prefix_cache="exact", dtype=dtype)
    assert_rows_invariant(llm)
    if tiled._dtype_ok(llm.model.layers[0].attention.wo.weight, llm.model.layers[0].attention.wo.weight.dtype):
        assert calls and set(calls) == {tiled.TILE}


@pytest.mark.parametrize("quantize,dtype,kv", [("int8-dynamic", "bf16", "int8"), ("int4", "fp32", None),
                                               (None, "fp32", "int8")])
def test_logprobs_are_a_cold_caches_in_any_company_and_chunking(quantize, dtype, kv):
    prompts = ["Once upon a time there was a little cat who liked to play in the park with her friend the dog.",
               "Once upon a time there was a little cat who liked to sleep.", "The bird sang a song."]
    llm = build(quantize=quantize, dtype=dtype, kv_cache_dtype=kv)
    opts = dict(temperature=0.0, max_gen_len=12, logprobs=True)
    alone, batch, cached, chunked = logprobs_in_any_company(llm, prompts, opts, longer=prompts[0] * 2)
    assert batch == alone and cached == alone and chunked == alone  # in a batch, from its blocks, in chunks
    assert llm.cache.pool.stats["cached_tokens"] >= 16


ROW_COUNTS = (1, 2, 5, 9, 17, 33, 40)  # a row alone, in our tiles of 1-4 rows, and past the 32 where oneDNN takes over


def assert_products_row_invariant(product, K, dtype=torch.float32):
    x = torch.randn(48, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    with invariant.rows():
        full = product(x)
        for m in ROW_COUNTS:
            assert torch.equal(product(x[:m]), full[:m]), m
            assert torch.equal(product(x[m : m + 1]), full[m : m + 1]), m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_and_int4_products_are_row_invariant_past_the_onednn_threshold(dtype):
    w = torch.randn(96, 512, generator=torch.Generator().manual_seed(0))
    q, scales = quantize_weight(w, torch.float32)
    assert_products_row_invariant(lambda x: cpu.int8_linear(x, q, scales), 512, dtype)
    codes, pairs = quantize_codes(w, 32)
    assert_products_row_invariant(lambda x: cpu.int4_linear(x, codes, pairs, 32), 512, dtype)
    for k in (512, 40):  # aten's packed int8 kernel, and a width it cannot take (a dequantized product)
        q, scales = quantize_weight(torch.randn(96, k), torch.bfloat16)
        assert_products_row_invariant(lambda x: weight_only_linear(x, q, scales), k, dtype)


@pytest.mark.parametrize("kind", list(gguf_blocks.NAMES.values()))
def test_every_gguf_block_product_is_row_invariant(kind):
    import gguf

    blocks = torch.from_numpy(np.ascontiguousarray(random_blocks(kind, 40, 512, std=512 ** -0.5)))
    qtype = int(gguf.GGMLQuantizationType[kind])
    assert_products_row_invariant(lambda x: cpu.gguf_linear(x, blocks, qtype), 512)


def test_compile_is_refused_with_exact_before_loading(tmp_path):
    from llama import Llama

    with pytest.raises(ValueError, match=r"compile=False with prefix_cache='exact', or prefix_cache='on'"):
        Llama.build(str(tmp_path / "absent"), None, 64, 1, prefix_cache="exact", compile=True)
