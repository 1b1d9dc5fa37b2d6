"""Q4_K repacked 8 rows at a time (llama/kernels/csrc/gguf_x8.h, what a GGUF load holds Q4_K weights in): the
layout converts back to the file's bytes exactly, dequantizes as gguf's numpy code does, and its products equal the
file layout's bit for bit (one row, a few rows, more than 8; the AVX2 and the AVX-512 VNNI copies; row counts
that leave rows past the last group of 8)."""

import hardware
import pytest
import torch
from conftest import STORIES, need
from gguf_blocks_data import dequantized, random_blocks, write_block_gguf

from llama.kernels import cpu
pytestmark = hardware.KERNELS

Q4_K = 12
VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu.cpu_flags()
COPIES = ["0", "1"] if VNNI else ["0"]  # LLAMA_CPU_AVX512: "0" forces the AVX2 copy


@pytest.mark.parametrize("n,k", [(16, 256), (20, 512), (7, 256), (43, 2816)])
def test_the_layout_goes_back_to_the_files_bytes_and_dequantizes_as_gguf(n, k):
    blocks = random_blocks("Q4_K", n, k, seed=n)
    w = torch.from_numpy(blocks)
    packed = cpu.gguf_repack(w)
    assert packed.shape == w.shape
    full = n // 8 * 8 * w.shape[1]  # the groups' bytes move; the rows past them stay
    assert full == 0 or not torch.equal(packed.view(-1)[:full], w.view(-1)[:full])
    assert torch.equal(packed.view(-1)[full:], w.view(-1)[full:])
    assert torch.equal(cpu.gguf_repack(packed, back=True), w)
    ids = torch.arange(n).flip(0)
    assert torch.equal(cpu.gguf_rows(packed, ids, cpu.Q4_K_X8), dequantized(blocks, "Q4_K")[ids])


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("n,k", [(24, 1024), (21, 512), (8, 2816)])
def test_products_equal_the_file_layouts_bit_for_bit(n, k, copy, monkeypatch):
    monkeypatch.setenv("LLAMA_CPU_AVX512", copy)  # read by the kernels on every call
    w = torch.from_numpy(random_blocks("Q4_K", n, k, seed=k + n))
    packed = cpu.gguf_repack(w)
    g = torch.Generator().manual_seed(n)
    for m in (1, 2, 3, 5, 9):  # one row, and 4- and 2-row steps with a row alone (gguf_x8_dot.h's linear_x8)
        x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
        x[0, :256] = 0.0  # an all-zero activation block
        ours, ref = cpu.gguf_linear(x, packed, cpu.Q4_K_X8), cpu.gguf_linear(x, w, Q4_K)
        assert torch.equal(ours, ref), (m, (ours - ref).abs().max().item())


def test_only_q4_k_repacks():
    with pytest.raises(RuntimeError, match="only Q4_K"):
        cpu.gguf_repack(torch.from_numpy(random_blocks("Q6_K", 8, 256)), 14)
    with pytest.raises(RuntimeError, match="not whole Q4_K blocks"):
        cpu.gguf_repack(torch.zeros(8, 100, dtype=torch.uint8))


def test_a_load_holds_q4_k_repacked_and_a_tied_output_shares_the_embedding(tmp_path, monkeypatch):
    """Q4_K_X8 is the int8 kernels' layout: the load repacks for LLAMA_GGUF_ACTIVATIONS=int8 (int16 and fp32
    activations read the file's layout, which test_gguf_x16.py and test_gguf_float.py cover)."""
    from llama import Llama, settings

    monkeypatch.setenv("LLAMA_GGUF_ACTIVATIONS", "int8")
    settings.reload()
    from llama.formats import gguf_quants
    from llama.quantization import gguf_blocks

    params = {"dim": 256, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 256, "norm_eps": 1e-5,
              "vocab_size": 512}
    path = write_block_gguf(tmp_path / "q4k.gguf", params, need(STORIES / "tokenizer.model"), "Q4_K", tied=True)
    model = Llama.build(str(path), None, max_seq_len=32, max_batch_size=1, compile=False).model
    assert gguf_quants.summary(model) == {"Q4_K": 5}  # wqkv, wo, w13, w2 and the tied output
    layers = [m for m in model.modules() if isinstance(getattr(m, "method", None), gguf_blocks.GGUFBlocks)]
    repacked = [m for m in layers if m.method.layout == cpu.Q4_K_X8]
    assert len(repacked) == 4 and model.output not in repacked  # the output is the embedding's own blocks
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    from gguf import GGUFReader

    w13 = model.layers[0].feed_forward.w13
    file = {t.name: torch.from_numpy(t.data.copy()).view(torch.uint8) for t in GGUFReader(path).tensors}
    expect = torch.cat([file["blk.0.ffn_gate.weight"], file["blk.0.ffn_up.weight"]]).view(w13.weight.shape)
    assert torch.equal(w13.method.file_blocks(w13), expect)
