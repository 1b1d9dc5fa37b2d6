"""The default model's Q4_1 file, run in its own blocks, against llama.cpp on the same file: every block product
(q/k/v, out, gate/up, down in all 30 layers, and the Q8_0 output) fed llama.cpp's own input for it equals llama.cpp's
result bit for bit, so our int8 activations are its q8_0/q8_1 blocks and our sums its sums. llama.cpp's intermediate
tensors come from its eval callback (cb_eval)."""

import ctypes

import hardware
import numpy as np
import pytest
import torch
from conftest import SHARED, need
from helpers import first_layers_gguf


pytestmark = hardware.KERNELS
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
    params.n_ctx, params.n_threads, params.n_threads_batch = 64, 1, 1  # 2 would spin against the other pytest worker
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


@pytest.fixture(autouse=True)
def int8_activations(monkeypatch):
    """llama.cpp's arithmetic (LLAMA_GGUF_ACTIVATIONS=int8): these tests compare its products bit for bit, where
    the default multiplies int16 activation blocks (closer to the file's weights, docs/performance.md)."""
    from llama import settings

    monkeypatch.setenv("LLAMA_GGUF_ACTIVATIONS", "int8")
    settings.reload()
    yield
    monkeypatch.undo()
    settings.reload()


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


def requantized(tmp_path_factory, ftype: str, layers: int = 0):
    """The shared Q4_1 file (cut to its first `layers` blocks, if given) quantized by llama.cpp's own quantizer to
    ftype."""
    src = need(SMOLLM)
    out = tmp_path_factory.mktemp(ftype) / f"SmolLM2-135M-Instruct.{ftype}.gguf"
    if layers:
        src = out.with_name(f"first-{layers}-layers.gguf")
        first_layers_gguf(need(SMOLLM), src, layers)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize, params.nthread = True, 1
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        pytest.fail("llama.cpp's quantizer failed")
    return out


# (file type, block types among its products: SmolLM2's 576 inputs are not whole super-blocks, so llama.cpp falls
# back to 32-value types there; no quantization of it holds Q2_K products, which test_gguf_q8k.py covers)
# IQ4_XS's quantizer searches each block (35 s for the whole model on one core): its first 4 layers hold 4 IQ4_XS
# products (every ffn_down), enough; the K-quant mixes need the whole depth for every type above.
K_FILES = [("Q4_K_M", {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}, 0), ("Q3_K_M", {"Q4_0", "Q5_1", "Q5_K"}, 0),
           ("Q2_K", {"Q3_K"}, 0), ("IQ4_XS", {"IQ4_XS"}, 4)]


@pytest.mark.parametrize("ftype,kinds,layers", K_FILES, ids=[f for f, _, _ in K_FILES])
def test_k_quant_products_equal_llama_cpps_bit_for_bit(ftype, kinds, layers, tmp_path_factory):
    """llama.cpp's quantizations of the same model: with q8_K activations and its order of fp32 operations, each
    product fed llama.cpp's input equals its result bit for bit. Q4_K: the rows llama.cpp multiplies one at a time
    (its repacked q4_K_8x8 gemv, which decodes; batches of 4 rows go through its gemm, which adds each 64 values'
    sum on its own, so a row's result would depend on its batch there: ours does not)."""
    from llama import Llama
    from llama.quantization import gguf_blocks

    path = requantized(tmp_path_factory, ftype, layers)
    peer = llama_cpp_tensors(path, TOKENS)
    model = Llama.build(str(path), None, max_seq_len=64, max_batch_size=1, compile=False).model
    gemv = slice(len(TOKENS) - len(TOKENS) % 4, None)  # the rows past the last whole group of 4
    seen = set()

    def check(layer, x, *names):
        kind = gguf_blocks.NAMES[layer.method.qtype]
        seen.add(kind)
        y, ref = layer(x[None])[0], torch.cat([peer[n] for n in names], dim=-1)
        rows = gemv if kind == "Q4_K" and y.shape[0] == len(TOKENS) else slice(None)
        assert torch.equal(y[rows], ref[rows]), (names, kind, (y[rows] - ref[rows]).abs().max().item())

    for i, block in enumerate(model.layers):
        a, f = block.attention, block.feed_forward
        if a.wqkv is not None:
            check(a.wqkv, peer[f"attn_norm-{i}"], f"Qcur-{i}", f"Kcur-{i}", f"Vcur-{i}")
        else:
            for name, out in (("wq", "Qcur"), ("wk", "Kcur"), ("wv", "Vcur")):
                check(getattr(a, name), peer[f"attn_norm-{i}"], f"{out}-{i}")
        check(a.wo, peer[f"kqv_out-{i}"], f"attn_out-{i}")
        if f.w13 is not None:
            check(f.w13, peer[f"ffn_norm-{i}"], f"ffn_gate-{i}", f"ffn_up-{i}")
        else:
            check(f.w1, peer[f"ffn_norm-{i}"], f"ffn_gate-{i}")
            check(f.w3, peer[f"ffn_norm-{i}"], f"ffn_up-{i}")
        check(f.w2, peer[f"ffn_swiglu-{i}"], f"ffn_out-{i}")
    assert kinds <= seen, seen
