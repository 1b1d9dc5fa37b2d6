"""A GGUF model run in its own blocks computes llama.cpp's logits bit for bit (llama/kernels/ggml_arith.py): each op
between the products (RMSNorm, RoPE, attention over the fp16 KV cache, SwiGLU) fed llama.cpp's own input equals
llama.cpp's tensor (its eval callback), and the whole model fed the same tokens gives llama-cpp-python's logits at
every position, so the greedy ids agree. llama-cpp-python's `Llama` runs attention without flash attention (its
default, flash_attn=False), which is what the ops follow."""

import ctypes
import os

import hardware
import numpy as np
import pytest
import torch
from conftest import need
from test_gguf_llama_cpp import SMOLLM, TOKENS, GGMLTensor, requantized


pytestmark = hardware.KERNELS
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
if b"AVX512 = 1" not in llama_cpp.llama_print_system_info():
    pytest.skip("hardware: llama.cpp here is built without AVX-512, whose 8-lane sums are not the 16-lane ones "
                "llama/kernels/ggml_arith.py follows", allow_module_level=True)

PROMPTS = ["Once upon a time", "def fibonacci(n):"]


def llama_cpp_steps(path, batches):
    """For each batch of tokens decoded in turn (llama.cpp's context without flash attention): {name: [every fp32
    result of that name, in graph order]}."""
    got, steps = {}, []

    def callback(t, ask, user_data):
        if ask:
            return True
        g = ctypes.cast(t, ctypes.POINTER(GGMLTensor)).contents
        ne, nb = list(g.ne), list(g.nb)
        if g.type == 0 and g.data and nb[0] == 4 and nb[1] == 4 * ne[0] and nb[2] == nb[1] * ne[1]:
            n = ne[0] * ne[1] * ne[2] * ne[3]
            data = np.ctypeslib.as_array(ctypes.cast(g.data, ctypes.POINTER(ctypes.c_float)), (n,))
            got.setdefault(g.name.decode(errors="replace"), []).append(torch.from_numpy(data.copy()))
        return True

    cb = llama_cpp.ggml_backend_sched_eval_callback(callback)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_threads, params.n_threads_batch = 64, 1, 1  # 2 would spin against the other pytest worker
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.cb_eval, params.cb_eval_user_data = cb, None
    ctx = llama_cpp.llama_init_from_model(model, params)
    try:
        for batch in batches:
            got.clear()
            ids = (llama_cpp.llama_token * len(batch))(*batch)
            if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(ids, len(batch))) != 0:
                pytest.fail("llama.cpp could not decode the tokens")
            steps.append(dict(got))
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    if "kqv_out-0" not in steps[0]:
        pytest.skip("llama.cpp's attention tensors could not be read (flash attention, or its struct changed)")
    return steps


@pytest.fixture(scope="module", autouse=True)
def llama_cpp_arithmetic():
    """llama.cpp's arithmetic is opt-in (LLAMA_GGML_ARITH=1; it costs decode speed): on for this module."""
    from llama import settings

    old = os.environ.get("LLAMA_GGML_ARITH")
    os.environ["LLAMA_GGML_ARITH"] = "1"
    settings.reload()
    yield
    if old is None:
        del os.environ["LLAMA_GGML_ARITH"]
    else:
        os.environ["LLAMA_GGML_ARITH"] = old
    settings.reload()


@pytest.fixture(scope="module")
def smollm():
    from llama import Llama

    gen = Llama.build(str(need(SMOLLM)), None, max_seq_len=64, max_batch_size=1, compile=False)
    assert gen.model.norm.ggml_arith, "LLAMA_GGML_ARITH=1: a GGUF model run in its blocks takes llama.cpp's arithmetic"
    return gen


def test_each_op_equals_llama_cpps_tensor_bit_for_bit(smollm):
    """A prompt's batch (llama.cpp's batched product for the attention dots) and then one token (its one-token
    dot over 8 cached keys), every layer: each op fed llama.cpp's input gives llama.cpp's result."""
    from llama.kernels import ggml_arith

    model, a = smollm.model, smollm.model.params
    steps = llama_cpp_steps(SMOLLM, [TOKENS, [504]])
    H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
    keys, values = [[] for _ in model.layers], [[] for _ in model.layers]
    start = 0
    for peer in steps:
        T = peer["embd"][0].numel() // a.dim
        pos = torch.arange(start, start + T)[None]
        for i, block in enumerate(model.layers):
            x = (peer["embd"] if i == 0 else peer[f"l_out-{i - 1}"])[0].view(T, -1)
            assert torch.equal(ggml_arith.rms_norm(x, block.attention_norm.weight, a.norm_eps),
                               peer[f"attn_norm-{i}"][0].view(T, -1)), ("attn_norm", i)
            q, k = peer[f"Qcur-{i}"], peer[f"Kcur-{i}"]  # the projection, its reshape, the rotation
            q_rot = ggml_arith.rope(q[1].view(1, T, H, D), pos, a.rope_theta)
            assert torch.equal(q_rot, q[2].view(1, T, H, D)), ("rope q", i)
            assert torch.equal(ggml_arith.rope(k[1].view(1, T, Hkv, D), pos, a.rope_theta),
                               k[2].view(1, T, Hkv, D)), ("rope k", i)
            keys[i].append(ggml_arith.fp16(k[2].view(T, Hkv, D)))
            values[i].append(ggml_arith.fp16(peer[f"Vcur-{i}"][1].view(T, Hkv, D)))
            ks, vs = torch.cat(keys[i]).transpose(0, 1)[None], torch.cat(values[i]).transpose(0, 1)[None]
            out = ggml_arith.attend(q_rot, ks, vs, pos, 0.125)
            assert torch.equal(out.view(T, -1), peer[f"kqv_out-{i}"][0].view(T, -1)), ("attention", i, T)
            h = peer[f"ffn_inp-{i}"][0].view(-1, a.dim)  # the last layer keeps only the rows with logits
            assert torch.equal(ggml_arith.rms_norm(h, block.ffn_norm.weight, a.norm_eps),
                               peer[f"ffn_norm-{i}"][0].view(h.shape)), ("ffn_norm", i)
            gate, up = peer[f"ffn_gate-{i}"][0].view(h.shape[0], -1), peer[f"ffn_up-{i}"][0].view(h.shape[0], -1)
            assert torch.equal(ggml_arith.swiglu(gate, up), peer[f"ffn_swiglu-{i}"][0].view(gate.shape)), ("swiglu", i)
        start += T


def compare(gen, path, tokens: int, n_batch: int, prompts=PROMPTS):
    """Per prompt: llama-cpp-python's logits at every prompt position (its prompt in batches of n_batch) and then
    along its greedy continuation, against ours fed the same tokens in the same passes; asserts bitwise equality
    and returns the continuations."""
    from llama.core.worker.kv_cache import KVCache

    llm = llama_cpp.Llama(str(path), n_ctx=128, n_batch=n_batch, n_threads=1, logits_all=True, verbose=False)
    model = gen.model
    assert model.layers[0].attention.cache_k.dtype == torch.float16  # llama.cpp's KV type, from the cache owner
    for prompt in prompts:
        ids = gen.tokenizer.encode(prompt, bos=False, eos=False)
        llm.reset()
        llm.eval(ids)
        KVCache(model, 1, 128)
        with torch.inference_mode():
            ours = torch.cat([model(torch.tensor([ids[i : i + n_batch]]), i)[0] for i in range(0, len(ids), n_batch)])
        peer = torch.from_numpy(llm.scores[: len(ids)].copy())
        assert torch.equal(ours, peer), (prompt, "prompt", (ours - peer).abs().max().item())
        theirs, mine = [], []
        for step in range(tokens):
            peer_logits = torch.from_numpy(llm.scores[llm.n_tokens - 1].copy())
            assert torch.equal(ours[-1], peer_logits), (prompt, "step", step)
            theirs.append(int(peer_logits.argmax()))
            mine.append(int(ours[-1].argmax()))
            llm.eval([theirs[-1]])
            with torch.inference_mode():
                ours = model(torch.tensor([[mine[-1]]]), len(ids) + step)[0]
        assert mine == theirs, prompt


def test_logits_and_greedy_ids_equal_llama_cpps(smollm):
    """The shared Q4_1 file: the prompt in one batch, then 64 greedy tokens one at a time, as llama-cpp-python
    generates."""
    compare(smollm, SMOLLM, 64, n_batch=256)


@pytest.mark.parametrize("ftype,n_batch", [("Q6_K", 256), ("Q4_K_M", 256), ("Q4_K_M", 1)])
def test_k_quant_files_logits_equal_llama_cpps(ftype, n_batch, tmp_path_factory):
    """llama.cpp's own Q6_K and Q4_K_M quantizations of the model, the prompts in one batch (Q4_K_M's 4+ tokens go
    through llama.cpp's repacked Q4_K gemm: llama/kernels/ggml_products.py) then 32 greedy tokens, and one token at a
    time then 4 (the one-token steps after a prompt are the batched cases' too; the suite's time goes elsewhere).
    Prompts of 8 tokens or more: tests/quantization/test_gguf_llama_cpp_batched.py."""
    from llama import Llama

    path = requantized(tmp_path_factory, ftype)
    gen = Llama.build(str(path), None, max_seq_len=128, max_batch_size=1, compile=False)
    compare(gen, path, 32 if n_batch > 1 else 4, n_batch)


@pytest.mark.parametrize("value", [None, "0"], ids=["default", "0"])
def test_off_by_default_keeps_our_arithmetic(value, monkeypatch):
    """Unset or LLAMA_GGML_ARITH=0: the GGUF model keeps our own arithmetic and the model's cache dtype."""
    from llama import Llama, settings

    if value is None:
        monkeypatch.delenv("LLAMA_GGML_ARITH")
    else:
        monkeypatch.setenv("LLAMA_GGML_ARITH", value)
    settings.reload()
    try:
        gen = Llama.build(str(need(SMOLLM)), None, max_seq_len=32, max_batch_size=1, compile=False)
    finally:
        monkeypatch.undo()
        settings.reload()
    assert not gen.model.norm.ggml_arith and not gen.model.layers[0].attention.ggml_arith
    assert gen.model.layers[0].attention.cache_k.dtype == torch.float32


def test_exact_mode_position_is_computed_alike_in_every_pass():
    """prefix_cache="exact" with llama.cpp's arithmetic: every token takes llama.cpp's one-token attention, so a
    position's logits are bitwise the same whole, chunked (a single token first), beside another row with a longer
    KV length, and decoded after the rest was prefilled; and they equal llama.cpp's fed one token at a time."""
    from llama import Llama
    from llama.core.scheduling.plan import Decode, Prefill, SetBlocks

    gen = Llama.build(str(need(SMOLLM)), None, max_seq_len=64, max_batch_size=4, prefix_cache="exact",
                      compile=False)
    runner, pool = gen.runner, gen.cache.pool
    for row in range(4):
        runner.execute([SetBlocks(rows=[row], blocks=[pool.allocate(pool.blocks_for(64))])])
    prompt = gen.tokenizer.encode(PROMPTS[0] + ", there was a little girl", bos=False, eos=False)
    other = gen.tokenizer.encode("The three primary colors are red, green and blue.", bos=False, eos=False)
    n = len(prompt)

    def prefill(rows, chunks, starts):
        width = max(map(len, chunks))
        op = Prefill(tokens=[c + [0] * (width - len(c)) for c in chunks], start=starts, rows=rows, last=None,
                     kv_len=max(starts) + width)
        return runner.execute([op])[0]

    whole = prefill([0], [prompt], [0])[0]
    got = [prefill([1], [prompt[s:e]], [s])[0] for s, e in ((0, 1), (1, 4), (4, n))]
    assert torch.equal(torch.cat(got), whole)
    both = prefill([3, 2], [other, prompt], [0, 0])
    assert torch.equal(both[1, :n], whole)
    prefill([2], [prompt[:-1]], [0])
    step = runner.execute([Decode(tokens=[0, 0, prompt[-1]], pos=[0, 0, n - 1], active=[2])])[0][2]
    assert torch.equal(step, whole[-1])
    llm = llama_cpp.Llama(str(SMOLLM), n_ctx=64, n_batch=1, n_threads=1, logits_all=True, verbose=False)
    llm.eval(prompt)
    assert torch.equal(whole, torch.from_numpy(llm.scores[:n].copy()))
    pool.clear()


def test_engine_requests_match_alone():
    """The engine's batches: each request's greedy tokens and logprobs are those it gets alone."""
    from llama import Llama

    gen = Llama.build(str(need(SMOLLM)), None, max_seq_len=96, max_batch_size=3, compile=False)
    prompts = ["Hi", *PROMPTS, "The capital of France is"]
    params = dict(temperature=0.0, max_gen_len=12, logprobs=True)
    batch = gen.text_completion(prompts, **params)
    for prompt, got in zip(prompts, batch):
        alone = gen.text_completion([prompt], **params)[0]
        assert got["tokens"] == alone["tokens"] and got["logprobs"] == alone["logprobs"], prompt
