"""llama.cpp's batched K-quant products in its arithmetic (LLAMA_GGML_ARITH=1, llama/kernels/ggml_products.py): a
prompt of 8 tokens or more fed in one batch (4 or more for Q4_K, which llama.cpp repacks) goes through llama.cpp's
tiled kernel or its repacked Q4_K gemm, and our products follow them: each K-quant product fed llama.cpp's input
equals llama.cpp's tensor at every token count, and a 37-token chat prompt in one batch gives llama-cpp-python's
logits bit for bit at every position, then 32 greedy tokens agree. llama.cpp's own quantizations of the shared
SmolLM2 (its K-quant products are ffn_down: the other tensors have 576 inputs, not whole super-blocks)."""

import ctypes
import os

import numpy as np
import pytest
import torch
from test_gguf_llama_cpp import requantized
from test_gguf_llama_cpp_arith import compare, llama_cpp, llama_cpp_arithmetic, llama_cpp_steps  # noqa: F401

# a SmolLM2 chat turn as its template writes it: 37 tokens
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
FILES = ["Q4_K_M", "Q6_K", "Q5_K_M"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """llama.cpp's quantizations of the shared file, made once for the module."""
    made = {}

    def get(ftype):
        if ftype not in made:
            made[ftype] = requantized(tmp_path_factory, ftype)
        return made[ftype]

    return get


def build(path):
    from llama import Llama

    gen = Llama.build(str(path), None, max_seq_len=128, max_batch_size=1, compile=False)
    assert gen.model.norm.ggml_arith
    return gen


@pytest.mark.parametrize("ftype", FILES)
def test_ffn_down_equals_llama_cpps_tensor_at_each_token_count(ftype, files):
    """Q4_K (repacked by llama.cpp: one-token dot below 4 tokens, 4-row gemm and its leftover rows from 4), Q5_K and
    Q6_K (one-token dot below 8, tiled from 8): each layer's down projection fed llama.cpp's input equals its
    result, for batches around both thresholds and the whole chat prompt."""
    path = files(ftype)
    gen = build(path)
    ids = gen.tokenizer.encode(CHAT, bos=False, eos=False)
    assert len(ids) == 37
    kinds = {type(b.feed_forward.w2.method).__name__ for b in gen.model.layers}
    assert all(getattr(b.feed_forward.w2.method, "ggml_products", False) for b in gen.model.layers), kinds
    for n in (3, 4, 6, 7, 8, 9, 37):
        peer = llama_cpp_steps(path, [ids[:n]])[0]
        for i, block in enumerate(gen.model.layers[:-1]):  # llama.cpp's last layer keeps only the output row
            x = peer[f"ffn_swiglu-{i}"][0].view(n, -1)
            y = block.feed_forward.w2(x[None])[0]
            ref = peer[f"ffn_out-{i}"][0].view(n, -1)
            assert torch.equal(y, ref), (ftype, n, i, type(block.feed_forward.w2.method).__name__,
                                         (y - ref).abs().max().item())


@pytest.mark.parametrize("ftype", FILES[:2])  # Q5_K's tiled product: the ffn_down test above (suite time)
def test_chat_prompt_in_one_batch_logits_and_greedy_ids_equal_llama_cpps(ftype, files):
    """The 37-token chat prompt in one batch (llama.cpp: n_batch 256, n_ubatch 512), every position's logits, then
    32 greedy tokens one at a time, each step's logits bit for bit."""
    compare(build(files(ftype)), files(ftype), 32, n_batch=256, prompts=[CHAT])


def test_four_row_q8_k_is_llama_cpps():
    """llama.cpp's 4-row quantizer (ggml_quantize_mat_q8_K_4x8, called in its library) takes the scale's sign
    positive when +max occurs in the block, where its one-row quantizer takes the first largest magnitude's: our
    4-row q8_K gives its scales and codes, our one-row one differs where -max comes first."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    try:
        quantize = getattr(lib, "_Z19ggml_quantize_mat_tILl8EL9ggml_type15EEvPKfPvll")  # <8, GGML_TYPE_Q8_K>
    except AttributeError:
        pytest.skip("llama.cpp's library does not export its 4-row q8_K quantizer")
    quantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 512, generator=g)
    x[0, 3], x[0, 100] = -5.0, 5.0  # -max first
    x[1, 7] = -6.0
    x[2, 300], x[2, 301] = 4.0, -4.0  # +max first
    nbytes = 16 + 4 * 256 + 2 * 64  # block_q8_Kx4: d[4], qs[1024] (8-byte runs of the 4 rows), bsums[64]
    out = ctypes.create_string_buffer(2 * nbytes)
    quantize(x.numpy().ctypes.data, ctypes.addressof(out), 4, 512)
    raw = np.frombuffer(bytes(out), dtype=np.uint8).reshape(2, nbytes)
    d = torch.from_numpy(raw[:, :16].copy().view(np.float32)).T  # (rows, blocks)
    qs = torch.from_numpy(raw[:, 16:16 + 1024].copy().view(np.int8)).view(2, 32, 4, 8)  # (block, run, row, 8)
    codes = qs.permute(2, 0, 1, 3).reshape(4, 512)
    q4, d4 = torch.ops.llama_ggml_mm.q8k(x, True)
    q1, d1 = torch.ops.llama_ggml_mm.q8k(x, False)
    assert torch.equal(d4, d) and torch.equal(q4, codes)
    assert not torch.equal(d1, d) and d1[0, 0] == -d[0, 0]


def test_kernel_choice_follows_llama_cpps_dispatch():
    """llama.cpp's choice on an AVX-512 x86 build: Q4_K with output rows a multiple of 8 is repacked (gemm from 4
    tokens); other Q4_K and Q3_K/Q5_K/Q6_K/IQ4_XS take the tiled kernel from 8; 32-value formats keep ours."""
    from llama.kernels.ggml_products import kernel

    assert [kernel(12, 576, t) for t in (1, 3, 4, 7, 8)] == ["one", "one", "x4", "x4", "x4"]
    assert [kernel(12, 578, t) for t in (4, 7, 8)] == ["one", "one", "tiled"]
    for qtype in (11, 13, 14, 23):
        assert [kernel(qtype, 576, t) for t in (1, 7, 8, 37)] == ["one", "one", "tiled", "tiled"]
    assert kernel(8, 576, 37) == kernel(6, 576, 37) == kernel(10, 576, 37) == "one"


def test_engine_requests_match_alone_on_k_quants(files):
    """The engine pads prompts of one prefill to the longest: each row's products are chosen by its own token count
    (the prefill's last index per row), so a request's greedy tokens and logprobs are those it gets alone, on
    either side of Q4_K's 4-token and the tiled kernel's 8-token thresholds. Without a prefix cache: a prompt whose
    start was cached is prefilled from there, in other batches (as llama.cpp's own reuse of its KV cache does)."""
    from llama import Llama

    gen = Llama.build(str(files("Q4_K_M")), None, max_seq_len=96, max_batch_size=4, compile=False,
                      prefix_cache="off")
    prompts = ["Hi", "The capital of France is", "Once upon a time, in a land far away", CHAT]
    assert [len(gen.tokenizer.encode(p, bos=False, eos=False)) for p in prompts][:3] == [1, 5, 10]
    params = dict(temperature=0.0, max_gen_len=8, logprobs=True)
    batch = gen.text_completion(prompts, **params)
    for prompt, got in zip(prompts, batch):
        alone = gen.text_completion([prompt], **params)[0]
        assert got["tokens"] == alone["tokens"] and got["logprobs"] == alone["logprobs"], prompt
