"""python -m llama.convert: llama2.c (v0, v1) and Hugging Face checkpoints into the Meta layout."""

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, STORIES, rank_env

from llama.cli.convert import derive_ffn, main, read_safetensors
from llama.core.worker.kv_cache import KVCache
from llama.formats.checklist import verify_checklist
from llama.formats.meta_checkpoint import expected_shapes, read_params
from llama.model import ModelArgs, Transformer, ffn_hidden_dim

BIN = STORIES / "llama2c" / "stories260K.bin"


def stories():
    if not BIN.is_file() or not (STORIES / "consolidated.00.pth").is_file():
        pytest.skip(f"shared stories260K model not found at {STORIES} (expected <repo root>/../shared)")
    return STORIES


def reference():
    return torch.load(stories() / "consolidated.00.pth", weights_only=True)


def assert_same(out_dir, ref):
    got = torch.load(Path(out_dir) / "consolidated.00.pth", weights_only=True)
    assert set(got) == set(ref) - {"rope.freqs"}
    for name, t in got.items():
        assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name


# --------------------------------------------------------------------------------------------- llama2.c


def test_llama2c_v0_gives_the_meta_checkpoint_exactly(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "llama.convert", "llama2c", str(BIN), str(out), "--tokenizer",
                           str(stories() / "tokenizer.model")], capture_output=True, text=True, cwd=REPO,
                          env=rank_env(1), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert_same(out, reference())
    assert read_params(out) == read_params(STORIES)
    assert (out / "params.json").read_bytes() == (STORIES / "params.json").read_bytes()
    assert verify_checklist(out) == ["consolidated.00.pth", "params.json", "tokenizer.model"]


def write_v1(path, state, n_layers, header, shared):
    """llama2.c export.py's version1_export layout, written independently of the converter."""
    dim, hidden, _, n_heads, n_kv, vocab, seq_len = header
    head = struct.pack("<I", 0x616B3432) + struct.pack("<i", 1) + struct.pack("<7i", *header)
    head += struct.pack("B", int(shared))
    head += b"\0" * (256 - len(head))
    L = range(n_layers)
    order = ([f"layers.{i}.attention_norm.weight" for i in L] + [f"layers.{i}.ffn_norm.weight" for i in L]
             + ["norm.weight", "tok_embeddings.weight"]
             + [f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo") for i in L]
             + [f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3") for i in L])
    if not shared:
        order.append("output.weight")
    with open(path, "wb") as f:
        f.write(head)
        for name in order:
            f.write(state[name].float().contiguous().numpy().tobytes())


@pytest.mark.parametrize("shared", [True, False])
def test_llama2c_v1_header(tmp_path, shared):
    ref = reference()
    if not shared:
        ref["output.weight"] = torch.randn(512, 64)
    write_v1(tmp_path / "m.bin", ref, 5, (64, 172, 5, 8, 4, 512, 512), shared)
    assert main(["llama2c", str(tmp_path / "m.bin"), str(tmp_path / "out")]) == 0
    assert_same(tmp_path / "out", ref)
    assert read_params(tmp_path / "out") == read_params(STORIES)


def test_llama2c_v0_unshared_classifier(tmp_path):
    """Legacy files flag an unshared classifier with a negative vocab_size and append output.weight."""
    ref = reference()
    ref["output.weight"] = torch.randn(512, 64)
    data = bytearray(BIN.read_bytes())
    data[20:24] = struct.pack("<i", -512)
    data += ref["output.weight"].numpy().tobytes()
    (tmp_path / "m.bin").write_bytes(bytes(data))
    assert main(["llama2c", str(tmp_path / "m.bin"), str(tmp_path / "out")]) == 0
    assert_same(tmp_path / "out", ref)


def test_llama2c_refusals(tmp_path, capsys):
    data = BIN.read_bytes() if stories() else b""
    (tmp_path / "short.bin").write_bytes(data[:-100])
    assert main(["llama2c", str(tmp_path / "short.bin"), str(tmp_path / "o1")]) == 1
    assert f"short.bin has {len(data) - 100} bytes but its header" in capsys.readouterr().err
    q8 = struct.pack("<Ii7iB", 0x616B3432, 2, 64, 172, 5, 8, 4, 512, 512, 1).ljust(256, b"\0") + b"\0" * 1000
    (tmp_path / "q8.bin").write_bytes(q8)
    assert main(["llama2c", str(tmp_path / "q8.bin"), str(tmp_path / "o2")]) == 1
    assert "version 2 file (int8 Q8_0-quantised)" in capsys.readouterr().err
    assert main(["llama2c", str(BIN), str(tmp_path / "o3"), "--tokenizer", str(BIN.parent / "tok512.bin")]) == 1
    assert "tok512.bin is not a sentencepiece model" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in ("o1", "o2", "o3"))


@pytest.mark.parametrize("dim,hidden", [(64, 172), (288, 768), (4096, 11008), (5120, 13824), (8192, 28672),
                                        (4096, 14336), (64, 200), (100, 333), (32, 8)])
def test_derive_ffn_reproduces_hidden_dim(dim, hidden):
    multiple_of, mult = derive_ffn(dim, hidden)
    assert ffn_hidden_dim(dim, multiple_of, mult) == hidden
    known = {(64, 172): (4, None), (4096, 11008): (256, None), (8192, 28672): (4096, 1.3)}
    if (dim, hidden) in known:
        assert (multiple_of, mult) == known[(dim, hidden)]


# --------------------------------------------------------------------------------------------- Hugging Face

def write_safetensors(path, tensors):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 200,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
          "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "max_position_embeddings": 128, "hidden_act": "silu",
          "tie_word_embeddings": False, "rope_scaling": None, "torch_dtype": "float32"}


def meta_to_hf(meta, cfg):
    return helpers.meta_to_hf(meta, cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                              cfg["tie_word_embeddings"])


def random_meta(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    args = ModelArgs(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                     n_kv_heads=cfg["num_key_value_heads"], vocab_size=cfg["vocab_size"], multiple_of=8,
                     ffn_dim_multiplier=1.18)
    assert args.hidden_dim == cfg["intermediate_size"]
    meta = {n: torch.randn(s, generator=g) * 0.2 for n, s in expected_shapes(args).items()}
    for n in meta:
        if n.endswith("norm.weight"):
            meta[n] = 1 + 0.1 * meta[n]
    if cfg["tie_word_embeddings"]:
        meta["output.weight"] = meta["tok_embeddings.weight"]
    return meta


def hf_logits(w, cfg, tokens):
    """Hugging Face's Llama forward (rotate-half rotary on permuted q/k), written out plainly."""
    T, H, KV = len(tokens), cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = cfg["hidden_size"] // H, cfg["rms_norm_eps"]
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    emb = torch.cat([torch.outer(torch.arange(T).float(), inv)] * 2, -1)
    cos, sin = emb.cos(), emb.sin()

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    def rotate(x):
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin

    x = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rotate((h @ w[p + "self_attn.q_proj.weight"].T).view(T, H, hd).transpose(0, 1))
        k = rotate((h @ w[p + "self_attn.k_proj.weight"].T).view(T, KV, hd).transpose(0, 1))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, KV, hd).transpose(0, 1)
        k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1) @ v
        x = x + att.transpose(0, 1).reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ \
            w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms(x, w["model.norm.weight"]) @ head.T


def meta_logits(ckpt_dir, tokens):
    from llama.distributed.parallel import init_distributed
    from llama.formats.meta_checkpoint import load_state_dict

    init_distributed(1, torch.device("cpu"))
    args = ModelArgs.from_params(read_params(ckpt_dir))
    model = Transformer(args)
    model.load_state_dict(load_state_dict(ckpt_dir, args, 0, 1))
    KVCache(model, 1, len(tokens))
    return model(torch.tensor([tokens]))[0]


def write_hf_dir(d, cfg, meta, fmt="safetensors", dtype=torch.float32):
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    hf = {k: v.to(dtype) for k, v in meta_to_hf(meta, cfg).items()}
    if fmt == "bin":
        torch.save(hf, d / "pytorch_model.bin")
        return hf
    names = list(hf)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in files.items():
        write_safetensors(d / fname, {k: hf[k] for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}))
    return hf


def test_hf_sharded_safetensors_converts_to_the_original_meta_weights(tmp_path):
    meta = random_meta(CONFIG)
    hf = write_hf_dir(tmp_path / "hf", CONFIG, meta)
    assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    assert_same(tmp_path / "out", meta)
    params = read_params(tmp_path / "out")
    assert (params["dim"], params["n_layers"], params["n_heads"], params["n_kv_heads"], params["vocab_size"]) == \
        (64, 2, 4, 2, 96)
    assert params["rope_theta"] == 50000.0 and params["norm_eps"] == 1e-6
    assert ModelArgs.from_params(params).hidden_dim == 200
    assert verify_checklist(tmp_path / "out") == ["consolidated.00.pth", "params.json"]
    # the converted model computes what the Hugging Face model computes
    tokens = [1, 5, 17, 33, 2, 95, 40, 7, 60, 61, 3]
    want = hf_logits(hf, CONFIG, tokens)
    got = meta_logits(tmp_path / "out", tokens)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # and the permutation matters: without undoing it the logits differ
    assert not torch.allclose(hf_logits(meta_to_hf(meta, CONFIG) | {
        "model.layers.0.self_attn.q_proj.weight": meta["layers.0.attention.wq.weight"]}, CONFIG, tokens), want,
        atol=1e-3)


def test_hf_tied_embeddings_from_pytorch_bin_two_shards(tmp_path):
    cfg = {**CONFIG, "tie_word_embeddings": True, "num_key_value_heads": 4}
    meta = random_meta(cfg, seed=3)
    write_hf_dir(tmp_path / "hf", cfg, meta, fmt="bin")
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"sp")
    assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "out"), "--shards", "2"]) == 0
    shards = [torch.load(tmp_path / "out" / f"consolidated.0{k}.pth", weights_only=True) for k in range(2)]
    assert torch.equal(torch.cat([s["output.weight"] for s in shards]), meta["tok_embeddings.weight"])
    assert torch.equal(torch.cat([s["layers.1.attention.wk.weight"] for s in shards]), meta["layers.1.attention.wk.weight"])
    assert "n_kv_heads" not in read_params(tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == b"sp"


def test_hf_bf16_kept_or_cast(tmp_path):
    meta = random_meta(CONFIG, seed=4)
    write_hf_dir(tmp_path / "hf", CONFIG, meta, dtype=torch.bfloat16)
    assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "bf16")]) == 0
    got = torch.load(tmp_path / "bf16" / "consolidated.00.pth", weights_only=True)
    assert got["layers.0.attention.wq.weight"].dtype == torch.bfloat16
    assert torch.equal(got["layers.0.attention.wq.weight"], meta["layers.0.attention.wq.weight"].bfloat16())
    assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    got = torch.load(tmp_path / "fp32" / "consolidated.00.pth", weights_only=True)
    assert got["norm.weight"].dtype == torch.float32


def test_hf_refusals(tmp_path, capsys):
    write_hf_dir(tmp_path / "hf", CONFIG, random_meta(CONFIG, seed=5))
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**CONFIG, "rope_scaling": {"type": "dynamic", "factor": 2}}))
    assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "o1")]) == 1
    assert "rope_scaling" in capsys.readouterr().err
    (tmp_path / "hf" / "config.json").write_text(json.dumps(CONFIG))
    write_safetensors(tmp_path / "hf" / "model-00002-of-00002.safetensors",
                      {"model.layers.1.self_attn.q_proj.bias": torch.zeros(64)})
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.1.self_attn.q_proj.bias"] = "model-00002-of-00002.safetensors"
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["hf", str(tmp_path / "hf"), str(tmp_path / "o2")]) == 1
    assert "unexpected tensor 'model.layers.1.self_attn.q_proj.bias'" in capsys.readouterr().err
    assert main(["hf", str(tmp_path / "nowhere"), str(tmp_path / "o3")]) == 1
    assert "config.json not found" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in ("o1", "o2", "o3"))


def test_safetensors_reader(tmp_path):
    t = {"a": torch.arange(6, dtype=torch.float16).view(2, 3), "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
         "c": torch.randn(4, 1)}
    write_safetensors(tmp_path / "x.safetensors", t)
    got = read_safetensors(tmp_path / "x.safetensors")
    assert set(got) == set(t)
    for k in t:
        assert got[k].dtype == t[k].dtype and torch.equal(got[k], t[k])
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match=r"cut\.safetensors is not a readable safetensors file \(truncated or corrupt"):
        read_safetensors(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"junk\.safetensors is not a readable safetensors file"):
        read_safetensors(tmp_path / "junk.safetensors")
