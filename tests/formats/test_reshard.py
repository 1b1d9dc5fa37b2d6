"""python -m llama.reshard: rewrite a checkpoint with another shard count, verified and loadable."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import GOLDENS, REPO, SHARED, STORIES, rank_env

from llama.formats.checklist import verify_checklist
from llama.formats.meta_checkpoint import load_state_dict, parallel_dim, read_params
from llama.formats.reshard import main, reshard
from llama.model import ModelArgs


@pytest.fixture(scope="module")
def stories():
    if not (STORIES / "consolidated.00.pth").is_file() or not GOLDENS.is_file():
        pytest.skip(f"shared stories260K model or goldens not found under {SHARED} (expected <repo root>/../shared)")
    return STORIES


@pytest.fixture(scope="module")
def two_shards(stories, tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard") / "two"
    proc = subprocess.run([sys.executable, "-m", "llama.reshard", str(stories), str(out), "--shards", "2", "--verify"],
                          capture_output=True, text=True, cwd=REPO, env=rank_env(1),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


def original():
    return torch.load(STORIES / "consolidated.00.pth", weights_only=True)


def test_cli_writes_shards_params_tokenizer_and_checklist(two_shards):
    names = sorted(p.name for p in two_shards.iterdir())
    assert names == ["checklist.chk", "consolidated.00.pth", "consolidated.01.pth", "params.json", "tokenizer.model"]
    assert verify_checklist(two_shards) == ["consolidated.00.pth", "consolidated.01.pth", "params.json",
                                            "tokenizer.model"]
    assert read_params(two_shards) == read_params(STORIES)
    assert (two_shards / "tokenizer.model").read_bytes() == (STORIES / "tokenizer.model").read_bytes()
    shards = [torch.load(two_shards / f"consolidated.0{k}.pth", weights_only=True) for k in range(2)]
    ref = original()
    for name, t in shards[0].items():
        dim = parallel_dim(name)
        merged = t if dim is None else torch.cat([s[name] for s in shards], dim)
        assert torch.equal(merged, ref[name]), name
    assert shards[1]["layers.4.feed_forward.w2.weight"].shape == (64, 86)


def test_reshard_back_to_one_and_to_four(two_shards, tmp_path):
    args = ModelArgs.from_params(read_params(STORIES))
    ref = original()
    reshard(two_shards, tmp_path / "one", 1)
    one = torch.load(tmp_path / "one" / "consolidated.00.pth", weights_only=True)
    assert set(one) == set(ref) - {"rope.freqs"}
    for name, t in one.items():
        assert torch.equal(t, ref[name]), name
    reshard(two_shards, tmp_path / "four", 4)
    parts = [load_state_dict(tmp_path / "four", args, r, 2) for r in range(2)]
    direct = [load_state_dict(two_shards, args, r, 2) for r in range(2)]
    for name in ref:
        if name != "rope.freqs":
            assert torch.equal(parts[1][name], direct[1][name]), name


def test_resharded_checkpoint_gives_golden_greedy_ids_at_world_size_1(two_shards):
    from llama.generation import Llama

    goldens = json.loads(GOLDENS.read_text())
    llama = Llama.build(str(two_shards), str(two_shards / "tokenizer.model"), max_seq_len=160, max_batch_size=2,
                        device="cpu", dtype="float32")
    tokens, _ = llama.generate([g["prompt_tokens"] for g in goldens.values()], max_gen_len=128, temperature=0.0)
    for got, g in zip(tokens, goldens.values()):
        assert got == g["generated_tokens"]


def test_impossible_shard_count_writes_nothing(stories, tmp_path, capsys):
    assert main([str(stories), str(tmp_path / "three"), "--shards", "3"]) == 1
    assert "model parallel size 3 does not divide n_heads (8)" in capsys.readouterr().err
    assert not (tmp_path / "three").exists()


def test_refuses_to_mix_with_existing_shards_or_overwrite_input(two_shards, tmp_path, capsys):
    assert main([str(two_shards), str(two_shards), "--shards", "1"]) == 1
    assert "is the input directory" in capsys.readouterr().err
    (tmp_path / "consolidated.00.pth").write_bytes(b"old")
    assert main([str(two_shards), str(tmp_path), "--shards", "1"]) == 1
    assert "already holds *.pth files" in capsys.readouterr().err
    assert (tmp_path / "consolidated.00.pth").read_bytes() == b"old"


def test_verify_refuses_a_corrupt_input(two_shards, tmp_path, capsys):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(two_shards, src)
    data = bytearray((src / "consolidated.01.pth").read_bytes())
    data[-2000] ^= 1
    (src / "consolidated.01.pth").write_bytes(bytes(data))
    assert main([str(src), str(tmp_path / "out"), "--shards", "1", "--verify"]) == 1
    assert "checksum mismatch" in (err := capsys.readouterr().err) and "consolidated.01.pth" in err
    assert not (tmp_path / "out").exists()
