"""Loading Meta-layout checkpoints at any shard count and world size, and refusing bad ones clearly."""

import hashlib
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, STORIES, rank_env

from llama.formats import meta_checkpoint
from llama.formats.checklist import verify_checklist
from llama.formats.meta_checkpoint import (
    expected_shapes,
    load_shard,
    load_state_dict,
    parallel_dim,
    read_params,
    save_checkpoint,
)
from llama.model import ModelArgs


def stories():
    if not (STORIES / "consolidated.00.pth").is_file():
        pytest.skip(f"shared model stories260K not found at {STORIES} (expected <repo root>/../shared)")
    return STORIES


def random_checkpoint(params: dict, seed: int = 0):
    """A full random state dict matching params (vocab_size must be set)."""
    g = torch.Generator().manual_seed(seed)
    args = ModelArgs.from_params(params)
    return {name: torch.randn(shape, generator=g) for name, shape in expected_shapes(args).items()}


def merge(parts, name):
    dim = parallel_dim(name)
    return parts[0][name] if dim is None else torch.cat([p[name] for p in parts], dim)


def stories_args():
    return ModelArgs.from_params(read_params(stories()))


# --------------------------------------------------------------------------------------------- any S at any W


def test_same_shard_count_returns_the_mapped_tensors_without_copy():
    state = load_state_dict(stories(), stories_args(), 0, 1)
    ref = torch.load(STORIES / "consolidated.00.pth", weights_only=True)
    assert set(state) == set(ref) - {"rope.freqs"}
    for name, t in state.items():
        assert torch.equal(t, ref[name]), name
    # stories260K stores each layer's wq as a view of one 5-layer storage: a copy would own just its 64x64 floats
    wq = state["layers.0.attention.wq.weight"]
    assert wq.untyped_storage().nbytes() == 5 * wq.numel() * 4


@pytest.mark.parametrize("world", [2, 4])
def test_one_shard_splits_at_larger_world_sizes(world):
    args = stories_args()
    full = load_state_dict(stories(), args, 0, 1)
    parts = [load_state_dict(stories(), args, r, world) for r in range(world)]
    for name, t in full.items():
        dim = parallel_dim(name)
        if dim is not None:
            assert parts[0][name].shape[dim] == t.shape[dim] // world
            assert parts[0][name].is_contiguous()
        assert torch.equal(merge(parts, name), t), name


@pytest.mark.parametrize("shards,world", [(4, 1), (4, 2), (2, 4), (4, 4)])
def test_saved_shards_load_at_any_world_size(tmp_path, shards, world):
    params = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "multiple_of": 8, "vocab_size": 48,
              "norm_eps": 1e-5}
    full = random_checkpoint(params)
    save_checkpoint(full, params, tmp_path, shards)
    assert sorted(p.name for p in tmp_path.glob("*.pth")) == [f"consolidated.{i:02d}.pth" for i in range(shards)]
    one = torch.load(tmp_path / "consolidated.00.pth", weights_only=True)
    assert one["layers.0.attention.wq.weight"].shape == (32 // shards, 32)  # column parallel: rows split
    assert one["layers.0.attention.wo.weight"].shape == (32, 32 // shards)  # row parallel: columns split
    assert one["tok_embeddings.weight"].shape == (48, 32 // shards)  # ParallelEmbedding: embedding dim split
    assert one["norm.weight"].shape == (32,)
    args = ModelArgs.from_params(params)
    parts = [load_state_dict(tmp_path, args, r, world) for r in range(world)]
    for name, t in full.items():
        assert torch.equal(merge(parts, name), t), name


def save_vocab_split(full: dict, params: dict, out: Path, shards: int) -> None:
    """Meta's Llama 3 layout: tok_embeddings split by vocabulary (dim 0), every other tensor as Llama 2's."""
    save_checkpoint(full, params, out, shards)
    emb = full["tok_embeddings.weight"].chunk(shards, 0)
    for r in range(shards):
        path = out / f"consolidated.{r:02d}.pth"
        torch.save({**torch.load(path, weights_only=True), "tok_embeddings.weight": emb[r].clone()}, path)


@pytest.mark.parametrize("layout", ["embedding-dim", "vocabulary"])
@pytest.mark.parametrize("shards,world", [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)])
def test_tied_output_at_any_shard_count_and_world_size(tmp_path, layout, shards, world):
    """No output.weight (Llama 3.2 1B/3B): at world size 1 the output is the embedding's own tensor, even when the
    table is merged from shards; above, each rank gets the embedding's vocabulary rows as its output slice."""
    params = {"dim": 32, "n_layers": 1, "n_heads": 4, "multiple_of": 8, "vocab_size": 48, "norm_eps": 1e-5}
    full = random_checkpoint(params, seed=2)
    del full["output.weight"]
    (save_vocab_split if layout == "vocabulary" else save_checkpoint)(full, params, tmp_path, shards)
    if layout == "vocabulary" and shards > 1:
        assert torch.load(tmp_path / "consolidated.00.pth", weights_only=True)["tok_embeddings.weight"].shape == \
            (48 // shards, 32)
    args = ModelArgs.from_params(params)
    parts = [load_state_dict(tmp_path, args, r, world) for r in range(world)]
    emb = full["tok_embeddings.weight"]
    assert torch.equal(merge(parts, "tok_embeddings.weight"), emb)
    assert torch.equal(merge(parts, "output.weight"), emb)
    if world == 1:
        assert parts[0]["output.weight"] is parts[0]["tok_embeddings.weight"]


def test_slices_that_straddle_shards(tmp_path):
    """2 shards at world size 3: rank 1's slice is the end of shard 0 and the start of shard 1."""
    params = {"dim": 48, "n_layers": 1, "n_heads": 6, "multiple_of": 6, "vocab_size": 60, "norm_eps": 1e-5}
    full = random_checkpoint(params, seed=1)
    save_checkpoint(full, params, tmp_path, 2)
    args = ModelArgs.from_params(params)
    parts = [load_state_dict(tmp_path, args, r, 3) for r in range(3)]
    assert parts[1]["layers.0.attention.wq.weight"].shape == (16, 48)
    for name, t in full.items():
        assert torch.equal(merge(parts, name), t), name


def test_vocab_size_from_tokenizer_is_taken_from_the_weights(tmp_path):
    params = {"dim": 32, "n_layers": 1, "n_heads": 4, "multiple_of": 8, "vocab_size": 40, "norm_eps": 1e-5}
    save_checkpoint(random_checkpoint(params), {**params, "vocab_size": -1}, tmp_path, 2)
    state = load_state_dict(tmp_path, ModelArgs.from_params(read_params(tmp_path)), 1, 2)
    assert state["output.weight"].shape == (20, 32)


# --------------------------------------------------------------------------------------------- refusals


def test_world_size_not_dividing_heads_fails_before_reading_files(tmp_path):
    with pytest.raises(ValueError, match=r"model parallel size 3 does not divide n_heads \(8\)"):
        load_state_dict(stories(), stories_args(), 0, 3)
    # the check comes first: even a garbage shard is not opened
    (tmp_path / "consolidated.00.pth").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="does not divide n_heads"):
        load_state_dict(tmp_path, stories_args(), 0, 3)


def test_kv_heads_must_divide_too():
    args = ModelArgs(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=64, multiple_of=4)
    with pytest.raises(ValueError, match=r"does not divide n_kv_heads \(2\)"):
        load_state_dict("/nonexistent", args, 0, 4)


def test_validation_happens_before_any_slice_is_taken(tmp_path, monkeypatch):
    params = {"dim": 32, "n_layers": 2, "n_heads": 4, "multiple_of": 8, "vocab_size": 48, "norm_eps": 1e-5}
    save_checkpoint(random_checkpoint(params), params, tmp_path, 2)
    bad = ModelArgs.from_params({**params, "n_layers": 3})

    def no_reading(*a, **k):
        raise AssertionError("tensor data read before validation")

    monkeypatch.setattr(meta_checkpoint.ShardSet, "slice", no_reading)
    with pytest.raises(ValueError, match=r"lacks 9 tensor\(s\).*n_layers=3.*layers\.2\."):
        load_state_dict(tmp_path, bad, 0, 1)


@pytest.mark.parametrize("change,pattern", [
    ({"n_kv_heads": 2}, r"layers\.0\.attention\.wk\.weight .* has shape \(32, 32\) but params\.json .* implies \(16, 32\)"),
    ({"multiple_of": 64}, r"feed_forward\.w1\.weight .* has shape \(88, 32\) .* FFN hidden dim=128.* implies \(128, 32\)"),
    ({"vocab_size": 50}, r"vocab_size is 50 .* tok_embeddings\.weight .* has 48 rows"),
    ({"n_layers": 1}, r"has 9 tensor\(s\) params\.json does not describe \(n_layers=1\), first .layers\.1\."),
])
def test_params_json_inconsistent_with_weights(tmp_path, change, pattern):
    params = {"dim": 32, "n_layers": 2, "n_heads": 4, "multiple_of": 8, "vocab_size": 48, "norm_eps": 1e-5}
    save_checkpoint(random_checkpoint(params), params, tmp_path, 2)
    with pytest.raises(ValueError, match=pattern):
        load_state_dict(tmp_path, ModelArgs.from_params({**params, **change}), 0, 1)


def test_shards_that_disagree(tmp_path):
    params = {"dim": 32, "n_layers": 1, "n_heads": 4, "multiple_of": 8, "vocab_size": 48, "norm_eps": 1e-5}
    save_checkpoint(random_checkpoint(params), params, tmp_path, 2)
    args = ModelArgs.from_params(params)
    path = tmp_path / "consolidated.01.pth"
    shard = torch.load(path, weights_only=True)
    shard["layers.0.attention.wq.weight"] = torch.zeros(8, 32)
    torch.save(shard, path)
    with pytest.raises(ValueError, match=r"shards disagree on layers\.0\.attention\.wq\.weight: consolidated\.00\.pth "
                                         r"has \(16, 32\).*consolidated\.01\.pth has \(8, 32\)"):
        load_state_dict(tmp_path, args, 0, 1)
    del shard["layers.0.attention.wq.weight"]
    torch.save(shard, path)
    with pytest.raises(ValueError, match=r"shards disagree: 'layers\.0\.attention\.wq\.weight' is in only one"):
        load_state_dict(tmp_path, args, 0, 1)


def test_missing_shard_in_the_numbering(tmp_path):
    params = {"dim": 32, "n_layers": 1, "n_heads": 4, "multiple_of": 8, "vocab_size": 48, "norm_eps": 1e-5}
    save_checkpoint(random_checkpoint(params), params, tmp_path, 4)
    (tmp_path / "consolidated.02.pth").unlink()
    with pytest.raises(FileNotFoundError, match=r"consolidated\.02\.pth is missing"):
        load_state_dict(tmp_path, ModelArgs.from_params(params), 0, 1)


def test_truncated_shard_is_a_clear_error(tmp_path):
    src = stories() / "consolidated.00.pth"
    data = src.read_bytes()
    (tmp_path / "consolidated.00.pth").write_bytes(data[: len(data) // 2])
    shutil.copy(src.parent / "params.json", tmp_path)
    with pytest.raises(ValueError, match=r"cannot load checkpoint file .*consolidated\.00\.pth \(truncated, corrupt"):
        load_state_dict(tmp_path, stories_args(), 0, 1)
    (tmp_path / "consolidated.00.pth").write_bytes(b"")
    with pytest.raises(ValueError, match=r"consolidated\.00\.pth \(truncated.*0 bytes"):
        load_shard(tmp_path / "consolidated.00.pth")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this calls open(marker, "w"): code execution in a checkpoint
        return (open, (self.marker, "w"))


def test_pickle_carrying_code_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"tok_embeddings.weight": torch.zeros(2, 2), "norm.weight": _RunsCode(str(marker))},
               tmp_path / "consolidated.00.pth")
    with pytest.raises(ValueError, match=r"refusing to load .*consolidated\.00\.pth: it pickles objects other than "
                                         r"tensors"):
        load_shard(tmp_path / "consolidated.00.pth")
    assert not marker.exists()


def test_legacy_non_zip_format_still_loads(tmp_path):
    """Files from torch < 1.6 cannot be memory-mapped: they are read whole, still with the weights-only loader."""
    ref = torch.load(stories() / "consolidated.00.pth", weights_only=True)
    torch.save(ref, tmp_path / "consolidated.00.pth", _use_new_zipfile_serialization=False)
    shutil.copy(stories() / "params.json", tmp_path)
    for world in (1, 2):
        parts = [load_state_dict(tmp_path, stories_args(), r, world) for r in range(world)]
        for name in parts[0]:
            assert torch.equal(merge(parts, name), ref[name]), name


def test_nested_dict_is_not_a_checkpoint(tmp_path):
    torch.save({"model": {"norm.weight": torch.zeros(2)}}, tmp_path / "consolidated.00.pth")
    with pytest.raises(ValueError, match="does not hold a flat dict of tensors"):
        load_shard(tmp_path / "consolidated.00.pth")


def test_unknown_tensor_name_is_named(tmp_path):
    torch.save({"layers.0.attention.bias": torch.zeros(2)}, tmp_path / "consolidated.00.pth")
    shutil.copy(stories() / "params.json", tmp_path)
    with pytest.raises(ValueError, match=r"holds tensor 'layers\.0\.attention\.bias', which is not a parameter"):
        load_state_dict(tmp_path, stories_args(), 0, 1)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_weights_that_need_scales_are_refused_naming_the_tensor(tmp_path, dtype):
    """Meta's 405B FP8 download stores float8 weights whose scales live in fp8_scales_*.pt: casting them without
    the scales would decode garbage silently, so they are refused."""
    params = {"dim": 32, "n_layers": 1, "n_heads": 4, "multiple_of": 8, "vocab_size": 48, "norm_eps": 1e-5}
    full = random_checkpoint(params)
    full["layers.0.feed_forward.w1.weight"] = full["layers.0.feed_forward.w1.weight"].to(dtype)
    save_checkpoint(full, params, tmp_path)
    with pytest.raises(ValueError, match=rf"holds layers\.0\.feed_forward\.w1\.weight as {dtype}"):
        load_state_dict(tmp_path, ModelArgs.from_params(params), 0, 1)


@pytest.mark.parametrize("key", ["quantization_args", "lora_args", "vision_chunk_size", "moe_args"])
def test_params_json_of_another_architecture_is_refused_naming_the_key(tmp_path, key):
    (tmp_path / "params.json").write_text(json.dumps({"dim": 2048, "n_layers": 16, key: {"group_size": 256}}))
    with pytest.raises(ValueError, match=rf"params\.json has '{key}': .* cannot compute"):
        read_params(tmp_path)


# --------------------------------------------------------------------------------------------- checklist


def test_checklist_of_the_shared_model_verifies():
    assert verify_checklist(stories()) == ["consolidated.00.pth", "params.json"]


def copy_model(tmp_path):
    for name in ("consolidated.00.pth", "params.json", "checklist.chk"):
        shutil.copy(stories() / name, tmp_path / name)
    return tmp_path


def test_checklist_mismatch_names_the_corrupt_file(tmp_path):
    d = copy_model(tmp_path)
    data = bytearray((d / "consolidated.00.pth").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte deep in the weights: torch.load would not notice
    (d / "consolidated.00.pth").write_bytes(bytes(data))
    load_shard(d / "consolidated.00.pth")  # still loads: only the checklist catches it
    with pytest.raises(ValueError, match=r"checksum mismatch .*consolidated\.00\.pth \(md5 [0-9a-f]{32}, expected "
                                         r"20bd9c68c1484576b6912ae4cee972fb\)"):
        verify_checklist(d)


def test_checklist_missing_pieces(tmp_path):
    d = copy_model(tmp_path)
    (d / "params.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"params\.json is listed in checklist\.chk but does not exist"):
        verify_checklist(d)
    (d / "checklist.chk").unlink()
    with pytest.raises(FileNotFoundError, match=r"checklist .*checklist\.chk not found"):
        verify_checklist(d)


def test_checklist_must_cover_every_shard_and_be_well_formed(tmp_path):
    d = copy_model(tmp_path)
    shutil.copy(d / "consolidated.00.pth", d / "consolidated.01.pth")
    with pytest.raises(ValueError, match=r"consolidated\.01\.pth is not listed in checklist\.chk"):
        verify_checklist(d)
    (d / "checklist.chk").write_text("not a checksum line\n")
    with pytest.raises(ValueError, match="line 1 is not"):
        verify_checklist(d)


def test_save_writes_reference_checklist_and_compact_shards(tmp_path):
    full = load_state_dict(stories(), stories_args(), 0, 1)
    params = read_params(stories())
    save_checkpoint(full, params, tmp_path, 2)
    lines = (tmp_path / "checklist.chk").read_text().splitlines()
    assert [l.split("  ")[1] for l in lines] == ["consolidated.00.pth", "consolidated.01.pth", "params.json"]
    for line in lines:
        digest, name = re.fullmatch(r"([0-9a-f]{32})  (\S+)", line).groups()
        assert hashlib.md5((tmp_path / name).read_bytes()).hexdigest() == digest
    if shutil.which("md5sum"):
        subprocess.run(["md5sum", "-c", "--quiet", "checklist.chk"], cwd=tmp_path, check=True)
    assert json.loads((tmp_path / "params.json").read_text()) == params
    # shards hold only their own bytes (views of stories260K's shared storages must not drag them along)
    total = sum(t.numel() * 4 for t in full.values())
    for k in range(2):
        assert (tmp_path / f"consolidated.{k:02d}.pth").stat().st_size < 0.6 * total
    with pytest.raises(FileExistsError, match="already holds"):
        save_checkpoint(full, params, tmp_path, 1)
    with pytest.raises(ValueError, match="model parallel size 3 does not divide"):
        save_checkpoint(full, params, tmp_path / "three", 3)


# --------------------------------------------------------------------------------------------- memory


MEASURE = textwrap.dedent("""
    import sys, torch
    from llama.formats.meta_checkpoint import load_state_dict, read_params
    from llama.model import ModelArgs

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    d, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    args = ModelArgs.from_params(read_params(d))
    before = hwm()
    state = load_state_dict(d, args, rank, world)
    total = sum(float(t.sum()) for t in state.values())  # touch every byte of the slice
    print(hwm() - before, sum(t.numel() * t.element_size() for t in state.values()))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for peak RSS")
def test_peak_memory_follows_the_rank_slice(tmp_path):
    """Loading rank 0 of 2 from a single 48 MB shard must not bring the whole file into memory."""
    params = {"dim": 512, "n_layers": 4, "n_heads": 8, "multiple_of": 256, "vocab_size": 4096, "norm_eps": 1e-5}
    save_checkpoint(random_checkpoint(params), params, tmp_path / "ckpt", 1)
    size = (tmp_path / "ckpt" / "consolidated.00.pth").stat().st_size
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), "0", "2"], capture_output=True,
                         text=True, cwd=REPO, env=rank_env(1), timeout=120)
    assert out.returncode == 0, out.stderr
    grown, slice_bytes = map(int, out.stdout.split())
    assert slice_bytes == pytest.approx(size / 2, rel=0.02)
    assert grown < 0.75 * size, f"peak RSS grew {grown / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file at W=2"
