"""The default model's Q4_1 file, run in its own blocks, against llama.cpp on the same file: every block product
(q/k/v, out, gate/up, down in all 30 layers, and the Q8_0 output) fed llama.cpp's own input for it equals llama.cpp's
result bit for bit, so our int8 activations are its q8_0/q8_1 blocks and our sums its sums. llama.cpp's intermediate
tensors come from its eval callback (cb_eval)."""

import ctypes

import numpy as np
import pytest
import torch
from conftest import SHARED, need

from llama.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels are not built here")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

SMOLLM = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENS = [1, 28, 9690, 198, 6, 504, 2114]


class GGMLTensor(ctypes.Structure):
    """The head of ggml.h's struct ggml_tensor, up to its name (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64,
    GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""

    _fields_ = [("type", ctypes.c_int32), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int32), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def llama_cpp_tensors(path, tokens):
    """{name: the first contiguous fp32 result of that name, (rows, ne0)} from one llama.cpp decode of tokens (one
    batch; the output rows are the last token's)."""
    got = {}

    def callback(t, ask, user_data):
        if ask:
            return True
        g = ctypes.cast(t, ctypes.POINTER(GGMLTensor)).contents
        ne, nb = list(g.ne), list(g.nb)
        name = g.name.decode(errors="replace")
        if g.type == 0 and g.data and nb[0] == 4 and nb[1] == 4 * ne[0] and name not in got:
            n = ne[0] * ne[1] * ne[2] * ne[3]
            data = np.ctypeslib.as_array(ctypes.cast(g.data, ctypes.POINTER(ctypes.c_float)), (n,))
            got[name] = torch.from_numpy(data.copy()).view(-1, ne[0])
        return True

    cb = llama_cpp.ggml_backend_sched_eval_callback(callback)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_threads, params.n_threads_batch = 64, 2, 2
    params.cb_eval, params.cb_eval_user_data = cb, None
    ctx = llama_cpp.llama_init_from_model(model, params)
    try:
        ids = (llama_cpp.llama_token * len(tokens))(*tokens)
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(ids, len(tokens))) != 0:
            pytest.fail("llama.cpp could not decode the tokens")
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    if "result_output" not in got:
        pytest.skip("llama.cpp's tensors could not be read (its struct ggml_tensor changed)")
    return got


def test_every_block_product_equals_llama_cpps_bit_for_bit():
    from llama import Llama

    path = need(SMOLLM)
    peer = llama_cpp_tensors(path, TOKENS)
    model = Llama.build(str(path), None, max_seq_len=64, max_batch_size=1, compile=False).model
    assert model.layers[0].attention.wqkv is not None and model.layers[0].feed_forward.w13 is not None

    def check(layer, x, *names):
        y = layer(x[None])[0]
        ref = torch.cat([peer[n] for n in names], dim=-1)
        assert y.dtype == torch.float32 and torch.equal(y, ref), (names, (y - ref).abs().max().item())

    for i, block in enumerate(model.layers):
        check(block.attention.wqkv, peer[f"attn_norm-{i}"], f"Qcur-{i}", f"Kcur-{i}", f"Vcur-{i}")
        check(block.attention.wo, peer[f"kqv_out-{i}"], f"attn_out-{i}")
        check(block.feed_forward.w13, peer[f"ffn_norm-{i}"], f"ffn_gate-{i}", f"ffn_up-{i}")
        check(block.feed_forward.w2, peer[f"ffn_swiglu-{i}"], f"ffn_out-{i}")
    check(model.output, peer["result_norm"], "result_output")  # the tied Q8_0 embedding table
