"""Each family's Hugging Face directory (tests/families.py) converted to GGUF by llama.cpp's own
convert_hf_to_gguf.py (from llama-cpp-python's source distribution, unpacked by tests/peers.py at install): the
file loads with Llama.build(path, None) to transformers' logits on the original directory, alone and at world size
2; and it serves. qwen2 and phi3 files keep Hugging Face's NeoX q/k order, so this is what proves the permutation."""

import json
import subprocess
import sys

import peers
import pytest
import torch
from conftest import error_lines, rank_env
from families import FAMILIES, our_logits, sentencepiece_model, sequence, write_byte_level_tokenizer, write_hf

from llama import Llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")


@pytest.fixture(scope="session")
def converter():
    """Path of llama.cpp's convert_hf_to_gguf.py (with its conversion package and gguf-py) in llama-cpp-python's
    sdist, unpacked by `python tests/peers.py` at install."""
    return peers.llama_cpp_tree() / "convert_hf_to_gguf.py"


# llama.cpp's converter reads Qwen3-MoE's vocabulary as a byte-level BPE tokenizer.json and names its pre-tokenizer
# by hashing how it splits a fixed text, which only a real Qwen vocabulary matches: for the random one here
# (families.write_byte_level_tokenizer) the run is told it is Qwen2's, for that file only. The tensors and the
# metadata the tests check are the converter's own.
BPE_FAMILIES = ("qwen3moe",)
# Every family converted by the converter's own main() in one process (one python, torch and transformers start
# instead of one per family); a failed conversion is kept by name, for that family's tests to report.
CONVERT_ALL = """
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as convert
from conversion import base
jobs, report = json.loads(sys.argv[2]), sys.argv[3]  # main() reads sys.argv: set per job below
own_pre, failed = base.TextModel.get_vocab_base_pre, {}
for name, hf, out, bpe in jobs:
    base.TextModel.get_vocab_base_pre = (lambda self, tokenizer: "qwen2") if bpe else own_pre
    sys.argv = [convert.__file__, hf, "--outtype", "f32", "--outfile", out]
    try:
        convert.main()
    except BaseException:  # SystemExit too: main() exits on what it refuses
        failed[name] = traceback.format_exc()
json.dump(failed, open(report, "w"))
"""


@pytest.fixture(scope="module")
def converted(converter, tmp_path_factory):
    """converted(name) -> (gguf path, transformers model, HF dir): every family converted at the first call."""
    done, failed = {}, {}

    def get(name):
        if not done:
            sp, jobs = sentencepiece_model(), []
            for family in FAMILIES:
                d, model = write_hf(family, tmp_path_factory.mktemp(family) / "hf", sp)
                if family in BPE_FAMILIES:
                    write_byte_level_tokenizer(d)
                done[family] = (d.parent / f"{family}.gguf", model, d)
                jobs.append([family, str(d), str(done[family][0]), family in BPE_FAMILIES])
            report = tmp_path_factory.mktemp("convert") / "failed.json"
            proc = subprocess.run([sys.executable, "-c", CONVERT_ALL, str(converter.parent), json.dumps(jobs),
                                   str(report)], capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
            failed.update(json.loads(report.read_text()))
        assert name not in failed, failed[name][-3000:]
        return done[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_llama_cpp_s_gguf_gives_transformers_logits(converted, name):
    """300 positions; Mistral's GGUF says `llama` and carries no window, so it agrees up to the window (24) only."""
    path, model, _ = converted(name)
    g = Llama.build(str(path), None, max_seq_len=320, max_batch_size=1, compile=False, dtype=torch.float32)
    seq = sequence(24 if name == "mistral" else 300)
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0]
    assert (our_logits(g, seq) - ref).abs().max() < 1e-4 * max(1.0, float(ref.abs().max()))


MP_SCRIPT = """
import json, sys, torch
from llama import Llama
seq, out = json.loads(sys.argv[1]), sys.argv[2]
for i, path in enumerate(sys.argv[3:]):
    g = Llama.build(path, None, max_seq_len=320, max_batch_size=1, compile=False, dtype=torch.float32)
    with g.cache.hold():
        logits = g.runner.logits([seq])[0].cpu()
    torch.save(logits, f"{out}.{i}.{torch.distributed.get_rank()}.pt")
"""


MP_FAMILIES = ["qwen2", "phi3-longrope", "granite"]


@pytest.fixture(scope="module")
def world_size_2(converted, tmp_path_factory):
    """One torchrun launch with 2 gloo ranks, each building every MP_FAMILIES file in turn: {name: [logits of rank
    0, rank 1]}."""
    paths = [str(converted(name)[0]) for name in MP_FAMILIES]
    tmp = tmp_path_factory.mktemp("world_size_2")
    (tmp / "run.py").write_text(MP_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(tmp / "run.py"), json.dumps(sequence(200)), str(tmp / "out"), *paths],
                          env=rank_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, error_lines(proc.stderr)
    return {name: [torch.load(tmp / f"out.{i}.{rank}.pt") for rank in range(2)] for i, name in enumerate(MP_FAMILIES)}


@pytest.mark.parametrize("name", MP_FAMILIES)
def test_world_size_2_gives_the_same_logits(converted, world_size_2, name):
    """torchrun with 2 gloo ranks: each rank cuts its slice (Qwen2's biases with their rows)."""
    _, model, _ = converted(name)
    seq = sequence(200)
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0]
    for got in world_size_2[name]:
        assert (got - ref).abs().max() < 1e-4 * max(1.0, float(ref.abs().max()))


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(converted, tmp_path):
    import gguf

    path, _, _ = converted("llama")
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gemma")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'gemma' is not supported \(supported: llama, qwen2, phi3, granite, "
                                         r"qwen3, qwen3moe, llama4\)"):
        Llama.build(str(tmp_path / "x.gguf"), None, max_seq_len=32, max_batch_size=1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_s_gguf_serves_what_the_python_api_gives(converted, name):
    """python -m llama.serve on the converted file: a greedy completion and a streamed one, equal to the Python
    API's with the same load options."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn", reason="the server needs the serve extra")
    from serve_util import Server

    path, _, _ = converted(name)
    local = Llama.build(str(path), None, max_seq_len=128, max_batch_size=2)
    prompt = "the quick brown fox"
    ref = local.text_completion([prompt], temperature=0, max_gen_len=24)[0]["generation"]
    s = Server(path, "--max_seq_len", "128", "--max_batch_size", "2")
    try:
        c = s.client()
        out = c.completions.create(model=path.name, prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == ref and out.usage.completion_tokens > 0
        streamed = c.completions.create(model=path.name, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed) == ref
    finally:
        s.close()
