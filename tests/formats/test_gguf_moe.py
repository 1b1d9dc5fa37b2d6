"""Mixture-of-experts GGUF files as llama.cpp makes them: Qwen3-MoE and Mixtral directories written by transformers
(tests/families.py, wide enough for K-quant super-blocks), converted by llama.cpp's convert_hf_to_gguf.py and
quantized to Q4_K_M by llama.cpp's own quantizer (llama-cpp-python). The experts run in their own blocks: the
logits equal those of the same file dequantized, the argmaxes agree with llama.cpp's on the file, a token's output
is the same alone, batched and through the engine, and world size 2 splits every expert at whole blocks. Mixtral's
older files, one tensor per expert, load as the newer ones do."""

import ctypes
import json
import subprocess
import sys

import hardware
import numpy as np
import peers
import pytest
import torch
from conftest import HOST_MEMORY, REPO, error_lines, rank_env
from helpers import PEAK_PROBE, rewrite_gguf
from families import converter_command, sentencepiece_model, sequence, write_byte_level_tokenizer, write_hf

from llama import Llama, settings
from llama.formats import gguf_quants
from llama.quantization import gguf_blocks

pytestmark = hardware.KERNELS
pytest.importorskip("transformers")
NAMES = ("qwen3moe-k", "mixtral-k")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (f32 file, Q4_K_M file), converted and quantized by llama.cpp."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's quantizer makes the files")
    converter = peers.llama_cpp_tree() / "convert_hf_to_gguf.py"
    sp, out = sentencepiece_model(), {}
    for name in NAMES:
        d, _ = write_hf(name, tmp_path_factory.mktemp(name) / "hf", sp)
        bpe = name.startswith("qwen3moe")
        if bpe:
            write_byte_level_tokenizer(d)
        f32, q4 = d.parent / f"{name}.f32.gguf", d.parent / f"{name}.Q4_K_M.gguf"
        proc = subprocess.run([*converter_command(converter, d, bpe), "--outtype", "f32", "--outfile", str(f32)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 1
        assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q4).encode(), ctypes.byref(params)) == 0
        out[name] = (f32, q4)
    return out

# logits' distance, relative to their largest, of two passes that differ by the default int16 activation blocks'
# rounding (gguf_x16.cpp): 1.1e-4 to 2.2e-4 measured on these 2-layer files, where fp32 activations kept within 1e-4
INT16_LOGITS = 1e-3


def logits(path, seq, **options):
    g = Llama.build(str(path), None, max_seq_len=160, max_batch_size=3, compile=False, dtype=torch.float32, **options)
    with g.cache.hold():
        return g, g.runner.logits([seq])[0].float()


@pytest.mark.parametrize("name", NAMES)
def test_k_quant_experts_run_in_their_blocks_to_the_dequantized_logits(files, name, monkeypatch):
    """Every expert's products are the file's Q4_K / Q6_K blocks (the router stays a float product), and give the
    logits of the same file dequantized at load (LLAMA_GGUF_BLOCKS=0) within the default arithmetic's rounding:
    int16 activation blocks (an expert's few rows never take the fp32 GEMM) err by up to 2^-16 of a block's largest
    value, 2e-4 of the logits' largest here (INT16_LOGITS)."""
    seq = sequence(100)
    g, native = logits(files[name][1], seq)
    experts = [ff for layer in g.model.layers for ff in layer.feed_forward.experts]
    assert all(isinstance(lin.method, gguf_blocks.GGUFBlocks) for ff in experts
               for lin in (ff.w13 or ff.w1, ff.w2)), "an expert is not running in its blocks"
    kinds = gguf_quants.summary(g.model)
    assert kinds.get("Q4_K", 0) >= len(experts) and g.model.layers[0].feed_forward.gate.weight.dtype == torch.float32
    monkeypatch.setenv("LLAMA_GGUF_BLOCKS", "0")
    settings.reload()
    try:
        _, dequantized = logits(files[name][1], seq)
    finally:
        monkeypatch.undo()
        settings.reload()
    assert (native - dequantized).abs().max() < INT16_LOGITS * max(1.0, float(dequantized.abs().max()))


@pytest.mark.parametrize("name", NAMES)
def test_argmaxes_agree_with_llama_cpp_on_the_same_file(files, name):
    """llama.cpp rounds activations to int8 and its KV cache to fp16 (our default keeps them float), and a random
    model's router flips on small differences: 89 (Qwen3-MoE) and 84 (Mixtral) of 100 positions agree (measured
    2026-11-29, llama-cpp-python 0.3.36); a wrong expert order or routing rule agrees on few."""
    llama_cpp = pytest.importorskip("llama_cpp")
    seq = sequence(100)
    _, ours = logits(files[name][1], seq)
    lc = llama_cpp.Llama(str(files[name][1]), n_ctx=160, logits_all=True, verbose=False, n_threads=2)
    lc.eval(seq)
    ref = torch.tensor(np.array(lc.scores[: len(seq)]))
    agree = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    assert agree >= 0.8, f"{name}: {agree:.2f} of the argmaxes agree"


def test_a_token_s_ids_are_the_same_alone_batched_and_through_the_engine(files):
    """Tokens grouped by expert: each row of an expert's block product is computed as it is alone."""
    g = Llama.build(str(files["qwen3moe-k"][1]), None, max_seq_len=160, max_batch_size=3, compile=False)
    prompts = [sequence(40, seed=2), sequence(11, seed=3), sequence(25, seed=4)]
    alone = [g.generate([p], max_gen_len=16, temperature=0)[0][0] for p in prompts]
    assert g.generate(prompts, max_gen_len=16, temperature=0)[0] == alone
    with g.engine(prefill_chunk=8) as engine:
        requests = [engine.submit(p, max_gen_len=16, temperature=0) for p in prompts]
        assert [r.result(timeout=120) and r.generated for r in requests] == alone


MP_SCRIPT = """
import json, sys, torch
from llama import Llama
from llama.quantization import gguf_blocks
seq = json.loads(sys.argv[1])
for i, path in enumerate(sys.argv[3:]):
    g = Llama.build(path, None, max_seq_len=160, max_batch_size=1, compile=False, dtype=torch.float32)
    ff = g.model.layers[0].feed_forward.experts[0]
    assert isinstance(ff.w2.method, gguf_blocks.GGUFBlocks), ff.w2.method
    with g.cache.hold():
        out = g.runner.logits([seq])[0].cpu()
    torch.save((out, ff.w2.input_size_per_partition), f"{sys.argv[2]}.{i}.{torch.distributed.get_rank()}.pt")
"""


def test_world_size_2_splits_every_expert_at_whole_blocks(files, tmp_path):
    """One torchrun for both files: Qwen3-MoE's 768-wide experts are 3 Q4_K blocks, split 512 + 256 between the
    ranks (as Qwen3-30B-A3B's are), Mixtral's 512 evenly; the logits are world size 1's within INT16_LOGITS (the
    all-reduce sums in another order, and int16 activation blocks can round a value the other way after it)."""
    seq = sequence(60)
    paths = [files[n][1] for n in NAMES]
    (tmp_path / "run.py").write_text(MP_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(tmp_path / "run.py"), json.dumps(seq), str(tmp_path / "out"), *map(str, paths)],
                          env=rank_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, error_lines(proc.stderr)
    widths = {"qwen3moe-k": (512, 256), "mixtral-k": (256, 256)}
    for i, name in enumerate(NAMES):
        _, ref = logits(paths[i], seq)
        for rank in range(2):
            got, width = torch.load(tmp_path / f"out.{i}.{rank}.pt")
            assert width == widths[name][rank]
            assert (got - ref).abs().max() < INT16_LOGITS * max(1.0, float(ref.abs().max()))


def per_expert_copy(src, dst) -> None:
    """src (an f32 file) rewritten as Mixtral's older files are: blk.N.ffn_{gate,up,down}.E.weight, one tensor per
    expert."""
    def split(reader):
        for t in reader.tensors:
            if "_exps." in t.name:
                yield from ((t.name.replace("_exps.", f".{e}."), t.data[e], None) for e in range(t.data.shape[0]))
            else:
                yield t.name, t.data, None

    rewrite_gguf(src, dst, split)


def test_one_tensor_per_expert_files_load_as_the_newer_ones(files, tmp_path):
    f32 = files["mixtral-k"][0]
    per_expert = tmp_path / "mixtral-per-expert.gguf"
    per_expert_copy(f32, per_expert)
    seq = sequence(50)
    _, want = logits(f32, seq)
    _, got = logits(per_expert, seq)
    assert torch.equal(got, want)


def test_each_expert_s_view_names_its_own_bytes_in_the_file(files):
    """The per-expert tensors cut from ffn_*_exps (and any row range) say where their bytes lie, so loading can drop
    each one's file pages once read (gguf_file.release). A 16-layer Qwen3-30B-A3B-shaped Q4_K_M file (6.53 GB,
    benchmarks/moe_gguf.py) loaded at a peak RSS of 10.9 GB while every expert but the first kept its pages, and of
    7.17 GB (1.05x the file over the interpreter's 0.34 GB) since (2026-11-29)."""
    from llama.formats import gguf_file

    path = files["qwen3moe-k"][1]
    reader = gguf_file.open_reader(path)
    gguf_file.read_params(reader, path)
    base = reader.data.ctypes.data
    views = [t for t in reader.tensors if np.shares_memory(t.data, reader.data)]
    experts = [t for t in views if ".ffn_gate." in t.name]
    assert len(experts) == 8 * 2  # every expert of both layers, as a view of the file
    for t in views:
        assert (t.data.ctypes.data - base, t.data.nbytes) == (int(t.data_offset), int(t.n_bytes)), t.name


@HOST_MEMORY
def test_a_bf16_moe_file_loads_within_1_15x_its_size(tmp_path):
    """A bf16 file's tensors are the weights in place, except what fusing copies (each expert's w1 and w3 into one
    w13): those sources' pages are released as each layer is done. While they were kept, the Qwen3-30B-A3B-shaped
    bf16 benchmark file (6.24 GB, 4 layers) peaked at 10.1 GB; it peaks at 6.65 GB since (2026-11-29)."""
    from benchmarks import moe_gguf

    vocab = peers.llama_cpp_tree() / "models" / "ggml-vocab-qwen2.gguf"
    base = moe_gguf.write_moe_gguf(tmp_path / "base.gguf", "BF16", shape=moe_gguf.tiny_shape(), vocab=vocab)
    big = moe_gguf.write_moe_gguf(tmp_path / "big.gguf", "BF16", vocab=vocab,
                                  shape=moe_gguf.tiny_shape(n_layers=4, n_experts=32, expert_dim=1024))
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(base), str(big)], capture_output=True, text=True,
                         env=rank_env(1), cwd=REPO, timeout=300)
    assert out.returncode == 0, error_lines(out.stderr)
    peak, size = json.loads(out.stdout.strip().splitlines()[-1])["peak"], big.stat().st_size
    assert peak <= 1.15 * size, (peak, size)
