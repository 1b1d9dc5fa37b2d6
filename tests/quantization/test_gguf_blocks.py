"""GGUF files whose matrices are K-quants, i-quants and the 32-value block formats run in their own blocks
(llama/formats/gguf_quants.py, llama/quantization/gguf_blocks.py): the model's logits are the dequantized weights
times the activations in each arithmetic (int16 blocks, fp32, int8 blocks) to fp32 rounding, greedy ids equal the dequantized model's, batches do not change a
row's result, and loading takes about the file's size in memory."""

import json
import subprocess
import sys

import hardware
import pytest
import torch
from conftest import CPU_KERNELS_ONLY, HOST_MEMORY, REPO, STORIES, need, rank_env
from helpers import PEAK_PROBE
from gguf_blocks_data import Q4_K_M, X16_TYPES, dequantized, reference_product, write_block_gguf, x16_reference_product

from llama import Llama
from llama.formats import gguf_quants
from llama.quantization import gguf_blocks

pytestmark = hardware.KERNELS

PARAMS = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 256, "norm_eps": 1e-5,
          "vocab_size": 512}
PROMPT = [1, 20, 30, 40]


def q4_k_m(name):
    return Q4_K_M.get(name, "Q4_K")


def build(path, **kw):
    return Llama.build(str(path), None, max_seq_len=64, max_batch_size=2, compile=False, **kw)


def reference_apply(self, layer, x):
    """A block layer's product as gguf's dequantized weights times the activations, in fp64: our int8 activation
    codes with int8 activations, int16 ones with int16 activations (the default; the formats gguf_x16.cpp does not
    decode run in fp32), x itself with fp32 ones (the weight's blocks as the file holds them: Q4_K's are repacked at
    load for int8)."""
    rows = x.reshape(-1, x.shape[-1])
    blocks, kind = self.file_blocks(layer).numpy(), gguf_blocks.NAMES[self.qtype]
    if self.activations == "int16" and kind in X16_TYPES:
        return x16_reference_product(rows, blocks, kind).float().view(*x.shape[:-1], -1).to(x.dtype)
    if self.activations in ("float", "int16"):
        ref = rows.double() @ dequantized(blocks, kind).double().T
        return ref.float().view(*x.shape[:-1], -1).to(x.dtype)
    ref = reference_product(rows, blocks, kind)
    return ref.float().view(*x.shape[:-1], -1).to(x.dtype)


def check_exact(gen, monkeypatch, seq):
    """Every block product of a forward pass over seq equals reference_apply on the same input, to fp32 rounding
    (compared product by product: over a whole model one activation code rounded the other way at an exact half
    would carry its 1/254 on). The pass runs every row in the row kernels a decode step uses (row-invariant
    arithmetic): a long prompt's rows would otherwise take the fp32 GEMM (tests/kernels/test_gguf_x16.py)."""
    from llama.kernels import invariant

    errors = []
    ours = gguf_blocks.GGUFBlocks.apply

    def both(self, layer, x):
        y, ref = ours(self, layer, x), reference_apply(self, layer, x)
        errors.append(((y - ref).abs().max() / ref.abs().max()).item())
        return y

    with monkeypatch.context() as m:
        m.setattr(gguf_blocks.GGUFBlocks, "apply", both)
        with invariant.rows():
            gen.model(torch.tensor([seq]), 0)
    assert len(errors) >= 4 * len(gen.model.layers) + 1 and max(errors) < 1e-6, errors


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    return write_block_gguf(tmp_path_factory.mktemp("blocks") / "q4km.gguf", PARAMS, need(STORIES / "tokenizer.model"),
                            q4_k_m)


@CPU_KERNELS_ONLY
def test_a_q4_k_m_file_runs_in_its_blocks_exactly_and_greedy_ids_equal_the_dequantized_model(q4km, monkeypatch):
    gen = build(q4km)
    # Q6_K embedding, output, v and down; Q4_K q, k, out and the fused gate/up (q and k do not fuse with a Q6_K v)
    assert gguf_quants.summary(gen.model) == {"Q4_K": 8, "Q6_K": 5}
    assert isinstance(gen.model.tok_embeddings, gguf_blocks.BlockEmbedding)
    assert gen.model.layers[0].feed_forward.w13 is not None and gen.model.layers[0].attention.wqkv is None
    from llama.loading import preload

    if preload.file_mappings():  # an unfused layer's blocks are the file's pages, not a copy
        wv = gen.model.layers[0].attention.wv.weight
        in_file = [s.data_ptr() for s in preload.mapped_storages([wv], preload.file_mappings())]
        assert wv.dtype == torch.uint8 and wv.untyped_storage().data_ptr() in in_file
    ids = gen.generate([PROMPT], max_gen_len=20, temperature=0)[0][0]
    check_exact(gen, monkeypatch, PROMPT + ids)
    with monkeypatch.context() as m:
        m.setattr(gguf_quants, "runs_natively", lambda *a: False)  # the dequantized load (a GPU's)
        ref = build(q4km)
    assert gguf_quants.summary(ref.model) == {} and ref.model.output.weight.dtype == torch.float32
    assert ref.generate([PROMPT], max_gen_len=20, temperature=0)[0][0] == ids


@CPU_KERNELS_ONLY
@pytest.mark.parametrize("activations", ["int16", "float", "int8"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q4_0", "IQ4_XS", "IQ4_NL", "Q5_0", "Q4_1",
                                  "Q5_1", "Q2_K", "Q3_K"])
def test_every_native_format_gives_dequantized_weights_times_the_activations(kind, activations, tmp_path,
                                                                              monkeypatch):
    """The default (int16 activation blocks), fp32 activations and llama.cpp's int8 activations
    (LLAMA_GGUF_ACTIVATIONS), each against its own fp64 reference."""
    from llama import settings

    monkeypatch.setenv("LLAMA_GGUF_ACTIVATIONS", activations)
    settings.reload()
    path = write_block_gguf(tmp_path / f"{kind}.gguf", PARAMS, need(STORIES / "tokenizer.model"), kind, tied=True)
    gen = build(path)
    assert gguf_quants.summary(gen.model) == {kind: 9}  # wqkv, wo, w13, w2 in 2 layers, and the tied output
    assert {m.method.activations for m in gen.model.modules() if isinstance(getattr(m, "method", None),
                                                                             gguf_blocks.GGUFBlocks)} == {activations}
    assert gen.model.output.weight.data_ptr() == gen.model.tok_embeddings.weight.data_ptr()
    check_exact(gen, monkeypatch, PROMPT + list(range(50, 60)))


@CPU_KERNELS_ONLY
@pytest.mark.parametrize("activations", ["int16", "float", "int8"])
def test_the_one_call_decode_step_takes_block_weights_and_gives_the_layer_by_layer_ids(q4km, monkeypatch,
                                                                                       activations):
    """In each arithmetic (the op's GGUF_X16, GGUF_FLOAT and GGUF schemes)."""
    from llama import settings
    from llama.kernels import fused_decode

    monkeypatch.setenv("LLAMA_GGUF_ACTIVATIONS", activations)
    settings.reload()
    gen = build(q4km)
    assert {m.method.activations for m in gen.model.modules()
            if isinstance(getattr(m, "method", None), gguf_blocks.GGUFBlocks)} == {activations}
    ran = []
    real_op = torch.ops.llama_cpu.decode_layers
    monkeypatch.setattr(fused_decode.torch.ops.llama_cpu, "decode_layers", lambda *a: ran.append(1) or real_op(*a),
                        raising=False)
    one_call = gen.generate([PROMPT], max_gen_len=8, temperature=0, logprobs=True)
    assert len(ran) == 7  # every decode step after the prompt's
    monkeypatch.setattr(fused_decode, "run", lambda *a, **k: None)  # layer by layer
    assert gen.generate([PROMPT], max_gen_len=8, temperature=0, logprobs=True) == one_call


def test_a_rows_tokens_do_not_depend_on_its_batch(q4km):
    gen = build(q4km)
    prompts = [PROMPT, [1, 99, 7, 300, 12, 5]]
    batch = [r[0] if isinstance(r, tuple) else r for r in gen.generate(prompts, max_gen_len=12, temperature=0)[0]]
    for prompt, ids in zip(prompts, batch):
        assert gen.generate([prompt], max_gen_len=12, temperature=0)[0][0] == ids


def test_quantize_on_a_block_file_requantizes_its_dequantized_weights(q4km):
    gen = build(q4km, quantize="int8")
    assert gguf_quants.summary(gen.model) == {}
    assert all(m.method.scheme == "int8" for m in gen.model.modules() if hasattr(m, "method"))


@CPU_KERNELS_ONLY
def test_types_our_kernels_do_not_run_load_dequantized_with_a_note(tmp_path, capfd):
    kinds = {"attention.wq.weight": "IQ3_XXS", "feed_forward.w1.weight": "IQ2_XXS"}
    path = write_block_gguf(tmp_path / "mixed.gguf", PARAMS, need(STORIES / "tokenizer.model"),
                            lambda n: kinds.get(n, "Q4_K"))
    gen = build(path)
    err = capfd.readouterr().err
    assert "mixed.gguf: IQ3_XXS tensors are dequantized at load" in err and "IQ2_XXS" in err
    assert "Q4_K tensors" not in err
    assert gen.model.layers[0].attention.wq.weight.dtype == torch.float32
    assert gguf_quants.summary(gen.model)["Q4_K"] > 0
    assert len(gen.generate([PROMPT], max_gen_len=4, temperature=0)[0][0]) == 4


def test_the_gpu_path_dequantizes_instead():
    class Reader:
        tensors = []

    assert not gguf_quants.runs_natively(Reader(), None, "cuda")
    assert not gguf_quants.runs_natively(Reader(), "int8", "cpu")


@HOST_MEMORY
def test_loading_a_q4_k_m_file_peaks_within_1_15x_its_size(q4km, tmp_path):
    """The weights are the file's pages (or copies of them, their pages released): a dequantizing load would
    take 3.5x (bf16) the file."""
    params = {**PARAMS, "dim": 2048, "n_layers": 6, "n_heads": 16, "n_kv_heads": 16, "vocab_size": 512}
    path = write_block_gguf(tmp_path / "big.gguf", params, need(STORIES / "tokenizer.model"), q4_k_m)
    size = path.stat().st_size
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(q4km), str(path)], capture_output=True, text=True,
                         env=rank_env(1), cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    assert peak <= 1.15 * size, (peak, size)


def test_row_parallel_splits_fall_on_block_boundaries(q4km):
    """The FFN splits where w2's blocks allow (evenly when they do; uneven ranks run in
    tests/distributed/test_gguf_stages.py); attention's inputs follow its heads, so a split through a block there
    is refused naming the tensor."""
    from llama.formats import gguf_file

    reader = gguf_file.open_reader(q4km)
    layer = [t for t in reader.tensors if t.name.startswith("blk.0.")]
    assert gguf_quants.ffn_bounds(layer, q4km, 768, 2) == [0, 512, 768]  # 3 super-blocks: 2 | 1
    assert gguf_quants.ffn_bounds(layer, q4km, 768, 3) == [0, 256, 512, 768]
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight \(Q6_K\) has 768 inputs, 3 blocks of 256: "
                                         r"too few for model parallel size 4"):
        gguf_quants.ffn_bounds(layer, q4km, 768, 4)
    t = next(t for t in layer if t.name == "blk.0.attn_output.weight")  # 256 inputs: 1 super-block
    with pytest.raises(ValueError, match=r"blk\.0\.attn_output\.weight \(Q4_K\) has 256 inputs in blocks of 256: "
                                         r"model parallel size 2 would give each rank 128 inputs"):
        gguf_quants.shard("layers.0.attention.wo.weight", t, gguf_quants.blocks(t), 0, 2, q4km)
    t = next(t for t in layer if t.name == "blk.0.ffn_down.weight")
    b = gguf_quants.blocks(t)
    parts = [gguf_quants.shard("layers.0.feed_forward.w2.weight", t, b, r, 2, q4km, [0, 512, 768]) for r in range(2)]
    assert [p.shape[1] for p in parts] == [2 * 210, 210] and torch.equal(torch.cat(parts, dim=1), b)


@CPU_KERNELS_ONLY
def test_a_split_file_loads_as_one_model(q4km, tmp_path):
    path = write_block_gguf(tmp_path / "split.gguf", PARAMS, need(STORIES / "tokenizer.model"), q4_k_m, split=7)
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) == 3 and not path.exists()
    whole = build(q4km).generate([PROMPT], max_gen_len=12, temperature=0)[0][0]
    for given in (parts[0], tmp_path):  # the first part, or the folder holding the parts
        gen = build(given)
        assert gguf_quants.summary(gen.model) == {"Q4_K": 8, "Q6_K": 5}
        assert gen.generate([PROMPT], max_gen_len=12, temperature=0)[0][0] == whole
    with pytest.raises(ValueError, match="pass its first part"):
        build(parts[1])
    parts[2].unlink()
    with pytest.raises(ValueError, match=r"part 3 of 3 \(split-00003-of-00003.gguf\) is missing"):
        build(parts[0])


def test_a_compiled_step_calls_the_block_kernels_to_the_eager_ids(q4km, capfd):
    """torch.compile traces the block products and the embedding lookup through their fake registrations
    (llama/kernels/cpu.py) and calls our kernels on the layers' own bytes."""
    eager = build(q4km).generate([PROMPT], max_gen_len=12, temperature=0)[0][0]
    compiled = Llama.build(str(q4km), None, max_seq_len=64, max_batch_size=2, compile=True)
    capfd.readouterr()
    assert compiled.generate([PROMPT], max_gen_len=12, temperature=0)[0][0] == eager
    out = capfd.readouterr()
    assert "Compiling the decode step" in out.out + out.err


@pytest.fixture(autouse=True)
def own_arithmetic(monkeypatch):
    """These tests check our own paths around the block products (the one-call step, the compiled step, products
    against dequantized weights), so they run without llama.cpp's arithmetic (LLAMA_GGML_ARITH=0), which skips the
    first two; tests/quantization/test_gguf_llama_cpp_arith.py covers it."""
    from llama import settings

    monkeypatch.setenv("LLAMA_GGML_ARITH", "0")
    settings.reload()
    yield
    monkeypatch.undo()
    settings.reload()
