"""The MoE benchmark's file (benchmarks/moe_gguf.py, issue 51) at a tiny shape: the GGUF qwen3moe metadata and
tensors of Qwen3-MoE as llama.cpp's converter names them, Q4_K_M's types where llama.cpp's quantizer puts them,
weights of the intended spread, and llama.cpp loads and runs the file; the bytes a token reads (benchmarks/moe.py)
count top_k of n_experts experts."""

import numpy as np
import pytest
from peers import llama_cpp_tree

from benchmarks import moe_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    vocab = llama_cpp_tree() / "models" / "ggml-vocab-qwen2.gguf"
    path = tmp_path_factory.mktemp("moe") / "tiny-Q4_K_M.gguf"
    return moe_gguf.write_moe_gguf(path, "Q4_K_M", shape=moe_gguf.tiny_shape(), vocab=vocab)


@pytest.fixture(scope="module")
def reader(tiny):
    """The file opened once: gguf-py takes seconds to parse its 151,936-token vocabulary."""
    return moe_gguf.open_reader(tiny)


def test_metadata_and_tensors_are_qwen3moe_q4_k_m(reader):
    import gguf

    shape = moe_gguf.tiny_shape()
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tokenizer.ggml.")}
    assert meta["general.architecture"] == "qwen3moe" and meta["general.file_type"] == 15  # MOSTLY_Q4_K_M
    assert {k.split(".", 1)[1]: v for k, v in meta.items() if k.startswith("qwen3moe.")} == {
        "context_length": 256, "embedding_length": 256, "block_count": 2, "feed_forward_length": 512,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 64,
        "attention.value_length": 64, "rope.freq_base": 1e6, "attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 256}
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 151936
    got = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type.name) for t in reader.tensors}
    assert len(got) == 3 + 12 * 2
    # GGUF's dimensions, innermost first, as llama.cpp's qwen3moe asks for them
    assert got["blk.0.ffn_gate_exps.weight"] == ((256, 256, 8), "Q4_K")
    assert got["blk.0.ffn_down_exps.weight"] == ((256, 256, 8), "Q4_K")
    assert got["blk.1.ffn_down_exps.weight"] == ((256, 256, 8), "Q6_K")  # use_more_bits: the last eighth
    assert got["blk.1.attn_v.weight"] == ((256, 128), "Q6_K") and got["blk.0.attn_v.weight"][1] == "Q4_K"
    assert got["blk.0.attn_q.weight"] == ((256, 256), "Q4_K") and got["blk.0.attn_k.weight"] == ((256, 128), "Q4_K")
    assert got["blk.0.ffn_gate_inp.weight"] == ((256, 8), "F32")
    assert got["blk.0.attn_q_norm.weight"] == ((64,), "F32") and got["blk.0.attn_k_norm.weight"] == ((64,), "F32")
    assert got["token_embd.weight"] == ((256, 151936), "Q4_K") and got["output.weight"] == ((256, 151936), "Q6_K")
    for name in ("blk.0.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"):
        t = next(t for t in reader.tensors if t.name == name)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert w.shape == (8, 256, 256) and abs(w.mean()) < 1e-3 and 0.015 < w.std() < 0.025, (name, w.std())
    assert moe_gguf.tensor_plan(shape, "BF16", 2, 100)[-1] == ("output.weight", (100, 256), "BF16")


def test_llama_cpp_loads_and_runs_it(tiny):
    llama_cpp = pytest.importorskip("llama_cpp")
    peer = llama_cpp.Llama(str(tiny), n_ctx=32, n_threads=1, verbose=False)
    peer.eval(peer.tokenize(b"Hello world"))
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(peer.ctx), shape=(peer.n_vocab(),))
    assert peer.n_vocab() == 151936 and np.isfinite(logits).all() and logits.std() > 0


def test_a_token_reads_top_k_of_the_experts(tiny, reader):
    sizes = moe_gguf.tensor_bytes(reader)
    experts = sum(v for k, v in sizes.items() if "_exps" in k)
    dense = sum(v for k, v in sizes.items() if "_exps" not in k and k != "token_embd.weight")
    row = sizes["token_embd.weight"] / 151936
    assert moe_gguf.bytes_per_token(reader)["read_gb"] * 1e9 == pytest.approx(dense + experts * 2 / 8 + row)
    assert moe_gguf.bytes_per_token(reader, 8)["read_gb"] * 1e9 == pytest.approx(dense + experts + row)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="scheme"):
        moe_gguf.tensor_plan(moe_gguf.tiny_shape(), "Q8_0", 2, 100)
    with pytest.raises(ValueError, match="layers"):
        moe_gguf.write_moe_gguf(tmp_path / "x.gguf", layers=0, shape=moe_gguf.tiny_shape())
    with pytest.raises(ValueError, match="dim"):
        moe_gguf.write_moe_gguf(tmp_path / "x.gguf", shape=moe_gguf.tiny_shape(dim=320))
