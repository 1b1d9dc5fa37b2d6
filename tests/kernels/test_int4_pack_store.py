"""The pack cache (llama/kernels/int4_pack_store.py): the first load of a pre-quantized int8 or int4 checkpoint writes the layers
it had to build (fused; int4 repacked for PyTorch's kernel), later loads take every one of them from the cache and
give identical logits; a corrupt cache is rebuilt and rewritten; the key separates ranks, sizes and checkpoints;
LLAMA_INT4_CACHE=0 writes nothing."""

import pytest
import torch
from conftest import ON_CUDA, STORIES, need

from llama import Llama
from llama.formats import quantized_checkpoint
from llama.hub.demo import write_random_checkpoint
from llama.kernels import cpu
from llama.kernels import int4_pack_store as pack_cache
from llama.quantization.cli import quantize_checkpoint

pytestmark = pytest.mark.skipif(ON_CUDA, reason="hardware: int4 runs on the CPU only (PyTorch's CPU int4 kernel)")

PARAMS = {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 64, "vocab_size": 512,
          "norm_eps": 1e-5}


@pytest.fixture(params=["int4", "int8"])
def int4_ckpt(request, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "cache"))
    src = write_random_checkpoint(tmp_path / "ckpt", PARAMS, seed=4, std=0.05)
    quantize_checkpoint(src, tmp_path / "q", request.param, progress=False)
    return tmp_path / "q"


def logits(ckpt):
    llama = Llama.build(str(ckpt), str(need(STORIES / "tokenizer.model")), 32, 2, compile=False)
    tokens = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    return llama.model(tokens, 0)


def test_second_load_uses_the_cache_without_repacking(int4_ckpt, tmp_path, monkeypatch, capsys):
    first = logits(int4_ckpt)
    files = list((tmp_path / "cache" / "int4pack").glob("*.pt"))
    assert len(files) == 1
    cached = torch.load(files[0], weights_only=True)
    layers = ["attention.wqkv", "feed_forward.w13"]  # fused: built at load
    int4 = cached["layers.0.attention.wqkv.packed"].dtype == torch.uint8
    if int4 and not cpu.available():  # PyTorch's kernel: every layer repacked
        layers += ["attention.wo", "feed_forward.w2"]
    names = [f"layers.{i}.{m}" for i in range(2) for m in layers] + (["output"] if len(layers) > 2 else [])
    assert set(cached) == {f"{k}.{t}" for k in names for t in ("packed", "scales")}

    take = quantized_checkpoint.Packs.take

    def only_hits(self, key, shapes):
        hit = take(self, key, shapes)
        assert hit is not None, f"{key} built again although the cache holds it"
        return hit

    monkeypatch.setattr(quantized_checkpoint.Packs, "take", only_hits)
    assert torch.equal(logits(int4_ckpt), first)
    monkeypatch.undo()
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "cache"))

    files[0].write_bytes(files[0].read_bytes()[:1000])  # truncated: ignored, rebuilt, rewritten
    assert torch.equal(logits(int4_ckpt), first)
    assert "ignoring the unreadable pack cache" in capsys.readouterr().err
    assert set(torch.load(files[0], weights_only=True)) == set(cached)


def test_cache_key_and_switch(int4_ckpt, tmp_path, monkeypatch):
    key = pack_cache.cache_path(int4_ckpt, 0, 1, 32)
    assert key != pack_cache.cache_path(int4_ckpt, 0, 2, 32) != pack_cache.cache_path(int4_ckpt, 1, 2, 32)
    assert key != pack_cache.cache_path(int4_ckpt, 0, 1, 64)
    (int4_ckpt / "consolidated.00.pth").touch()  # rewritten checkpoint files: a new key
    assert pack_cache.cache_path(int4_ckpt, 0, 1, 32) != key
    monkeypatch.setenv("LLAMA_INT4_CACHE", "0")
    assert pack_cache.cache_path(int4_ckpt, 0, 1, 32) is None
    logits(int4_ckpt)
    assert not (tmp_path / "cache" / "int4pack").exists()
