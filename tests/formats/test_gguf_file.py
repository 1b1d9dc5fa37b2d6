"""GGUF: the shared SmolLM2-135M-Instruct (Q4_1 matrices, Q8_0 embedding, tied output, byte-level BPE, ChatML
template) reproduces the independent fp32 goldens token for token, alone, batched and through the engine; its
embedded tokenizer and chat template give the golden ids; and bad files fail with errors naming the file."""

import contextlib
import json
import os

import numpy as np
import pytest
from conftest import HOST_MEMORY, REPO, SHARED, need, rank_env
from helpers import transformers_reading_gguf

from llama import Llama

GGUF = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GOLDENS = SHARED / "goldens" / "smollm2_greedy.json"


@contextlib.contextmanager
def dequantizing():
    """Loads that dequantize the file's blocks (LLAMA_GGUF_BLOCKS=0): the path a GPU takes, and the one whose
    memory use a test compares."""
    from llama import settings

    old = os.environ.get("LLAMA_GGUF_BLOCKS")
    os.environ["LLAMA_GGUF_BLOCKS"] = "0"
    settings.reset()
    try:
        yield
    finally:
        os.environ.pop("LLAMA_GGUF_BLOCKS") if old is None else os.environ.__setitem__("LLAMA_GGUF_BLOCKS", old)
        settings.reset()


@pytest.fixture(scope="module")
def smol():
    """The default path: the file's blocks in our kernels with int16 activation blocks (what a user gets)."""
    pytest.importorskip("gguf", reason="the gguf package reads GGUF files")
    return Llama.build(str(need(GGUF)), None, max_seq_len=256, max_batch_size=3)


@pytest.fixture(scope="module")
def golden():
    return json.loads(need(GOLDENS).read_text())


def test_greedy_ids_equal_the_goldens_alone_batched_and_through_the_engine(smol, golden):
    prompts = golden["prompts"]
    for text, g in prompts.items():
        assert smol.tokenizer.encode(text, bos=True, eos=False) == g["prompt_tokens"]  # the model adds no BOS
    ids = [g["prompt_tokens"] for g in prompts.values()]
    want = [g["generated_tokens"] for g in prompts.values()]
    batched, _ = smol.generate(ids, max_gen_len=64, temperature=0)
    assert batched == want
    assert [smol.generate([p], max_gen_len=64, temperature=0)[0][0] for p in ids] == want
    with smol.engine(prefill_chunk=3) as engine:
        requests = [engine.submit(text, max_gen_len=64, temperature=0) for text in prompts]
        texts = [r.result(timeout=120)["generation"] for r in requests]
    assert [r.generated for r in requests] == want
    assert texts == [g["text"] for g in prompts.values()]


def test_chat_prompt_ids_and_a_reply_that_stops_at_the_end_of_turn(smol, golden):
    chat = golden["chat"][0]
    assert smol.formatter.encode_dialog_prompt(chat["dialog"]) == chat["prompt_tokens"]
    reply = smol.chat_completion([chat["dialog"]], temperature=0, max_gen_len=40)[0]["generation"]["content"]
    assert reply == "The capital of France is Paris."
    assert "".join(smol.stream_chat(chat["dialog"], temperature=0, max_gen_len=40)) == reply
    with smol.engine() as engine:
        r = engine.submit(chat["dialog"], temperature=0, max_gen_len=40)
        r.result(timeout=60)
    assert r.finish_reason == "eos" and r.generated[-1] != smol.tokenizer.eos_id  # <|im_end|>, not in the text


def test_streamed_non_ascii_text_equals_the_returned_text(smol):
    target = " Café ☕ — 日本語のテキスト 🦙 naïve"
    ids = smol.tokenizer.encode(target, bos=False, eos=False)
    assert smol.tokenizer.decode(ids) == target

    def force(generated, logits):
        out = logits.new_full(logits.shape, float("-inf"))
        out[ids[len(generated)] if len(generated) < len(ids) else smol.tokenizer.eos_id] = 0.0
        return out

    deltas = list(smol.stream_completion("Say it:", logits_processors=[force], max_gen_len=60))
    assert "".join(deltas) == target == smol.text_completion(["Say it:"], logits_processors=[force],
                                                             max_gen_len=60)[0]["generation"]
    assert not any("\ufffd" in d for d in deltas) and len(deltas) > 5


def test_a_tokenizer_json_gives_the_same_ids(smol, tmp_path):
    from llama.tokenizers.sentencepiece import load_tokenizer

    tok = smol.tokenizer
    tok.tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
         "chat_template": tok.chat_template}))
    again = load_tokenizer(tmp_path / "tokenizer.json")
    text = "The three primary colors are red, 12345 and <|im_end|>"
    assert again.encode(text, bos=True, eos=True) == tok.encode(text, bos=True, eos=True)
    assert again.eos_id == tok.eos_id and again.chat_template == tok.chat_template


# ------------------------------------------------------------------------------------------------- bad files
def write_gguf(path, arch="llama", tensor=None):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.embedding_length", 64)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_uint32(f"{arch}.attention.head_count", 4)
    w.add_uint32(f"{arch}.feed_forward_length", 192)
    w.add_uint32(f"{arch}.vocab_size", 32)
    w.add_tensor(*(tensor or ("token_embd.weight", np.zeros((32, 64), dtype=np.float32))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_gguf_files_name_the_file_and_the_reason(tmp_path):
    need(GGUF)
    with pytest.raises(ValueError, match=r"arch\.gguf: architecture 'gpt2' is not supported"):
        Llama.build(str(write_gguf(tmp_path / "arch.gguf", "gpt2")), None, max_seq_len=16, max_batch_size=1)
    odd = write_gguf(tmp_path / "odd.gguf", tensor=("token_embd.weight", np.zeros((32, 64), dtype=np.int8)))
    from llama.formats import gguf_file
    with pytest.raises(ValueError, match=r"odd\.gguf: tensor token_embd\.weight has type I8, which is not supported"):
        gguf_file.read_state_dict(gguf_file.open_reader(odd), odd)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(GGUF.read_bytes()[: 3 << 20])
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        Llama.build(str(cut), None, max_seq_len=16, max_batch_size=1)


# ------------------------------------------------------------------------------------------------- conversion, parallel
def test_convert_gguf_to_meta_layout_loads_back(smol, golden, tmp_path):
    from llama.cli.convert import main

    assert main(["gguf", str(GGUF), str(tmp_path / "meta")]) == 0
    back = Llama.build(str(tmp_path / "meta"), str(tmp_path / "meta" / "tokenizer.json"), max_seq_len=64,
                       max_batch_size=1, compile=False)
    g = golden["prompts"]["Once upon a time"]
    assert back.generate([g["prompt_tokens"]], max_gen_len=16, temperature=0)[0][0] == g["generated_tokens"][:16]
    chat = golden["chat"][0]
    assert back.formatter.encode_dialog_prompt(chat["dialog"]) == chat["prompt_tokens"]


def test_world_size_2_is_refused_clearly_for_9_heads(tmp_path):
    """SmolLM2 has 9 query and 3 key/value heads: no model-parallel size but 1 and 3 divides them, and the
    refusal says so before any weight is dequantized."""
    from llama.formats import gguf_file
    from llama.loading.loader import gguf_model
    from llama.model import ModelArgs

    reader = gguf_file.open_reader(need(GGUF))
    args = ModelArgs.from_params(gguf_file.read_params(reader, GGUF))
    with pytest.raises(ValueError, match=r"model parallel size 2 does not divide n_heads \(9\)"):
        gguf_model(reader, GGUF, args, 0, 2, "cpu", None, None)


MP_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from llama import Llama
torch.set_num_threads(1)
path, goldens, out = sys.argv[1:]
g = Llama.build(path, None, max_seq_len=64, max_batch_size=2, device="cpu", compile=False)
prompts = [v["prompt_tokens"] for v in json.load(open(goldens))["prompts"].values()]
json.dump(g.generate(prompts, max_gen_len=16, temperature=0)[0], open(f"{out}.{dist.get_rank()}.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def test_gguf_under_model_parallel_gives_the_goldens(golden, tmp_path):
    """torchrun with 3 gloo ranks (the smallest size above 1 that divides SmolLM2's 9 and 3 heads): each rank
    cuts its slice of the dequantized GGUF, and every rank gives the goldens' greedy ids."""
    import subprocess
    import sys


    (tmp_path / "run.py").write_text(MP_SCRIPT)
    env = {**rank_env(3), "LLAMA_GGUF_BLOCKS": "0"}  # the fp32 goldens: dequantized (see dequantizing())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
                           str(tmp_path / "run.py"), str(need(GGUF)), str(GOLDENS), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = [g["generated_tokens"][:16] for g in golden["prompts"].values()]
    for rank in range(3):
        assert json.loads((tmp_path / f"out.{rank}.json").read_text()) == want


# ------------------------------------------------------------------------------------------------- 'llama' vocabularies
TEXTS = ["Hello world", " leading space", "two  spaces and\ttab\nnewline", "日本語のテキスト 🦙 émoji",
         "1234567 numbers 3.14", "", "a\n\n\nb", "Once upon a time, there was a little girl named Lily.",
         "ünïcödé ßtraße", "[INST] hi [/INST]", "def f(x):\n    return x ** 2  # comment"]


def test_a_gguf_sentencepiece_vocabulary_encodes_and_decodes_like_sentencepiece(llama2_tokenizer_path, tmp_path):
    """A 'llama' GGUF vocabulary (tokens, scores, types: what llama.cpp stores for Llama 2) rebuilt with the
    tokenizers package gives Meta's sentencepiece ids and text on the real Llama 2 tokenizer."""
    import sentencepiece as spm
    from helpers import write_meta_gguf

    from llama.formats import gguf_file
    from llama.tokenizers import huggingface
    model = llama2_tokenizer_path
    path = write_meta_gguf(tmp_path / "vocab.gguf", {}, {}, model, vocab_only=True)
    tok = huggingface.from_gguf(gguf_file.open_reader(path), path)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.add_bos) == (32000, 1, 2, True)
    for text in TEXTS:
        ids = sp.encode(text)
        assert tok.encode(text, bos=True, eos=True) == [1] + ids + [2], text
        assert tok.decode(ids) == sp.decode(ids), text


def test_stories260k_written_as_gguf_gives_the_goldens_in_f32_and_close_in_q8_0(goldens, tmp_path):
    """A Meta checkpoint written as llama.cpp writes it (Meta's q/k order, 'llama' vocabulary) loads to the
    reference greedy ids and logits; with Q8_0 matrices, teacher-forced argmaxes still agree almost everywhere."""
    import torch
    from conftest import STORIES
    from helpers import ONCE, write_meta_gguf

    golden_stories = goldens
    state = torch.load(need(STORIES / "consolidated.00.pth"), map_location="cpu")
    params = json.loads((STORIES / "params.json").read_text())
    meta = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=256, max_batch_size=2,
                       compile=False)
    f32 = write_meta_gguf(tmp_path / "f32.gguf", state, params, STORIES / "tokenizer.model")
    gen = Llama.build(str(f32), None, max_seq_len=256, max_batch_size=2, compile=False)
    for prompt, g in golden_stories.items():
        assert gen.tokenizer.encode(prompt, bos=True, eos=False) == g["prompt_tokens"]
        out = gen.text_completion([prompt], temperature=0, max_gen_len=len(g["generated_tokens"]))
        assert out[0]["generation"] == g["generation_text"]
    g = golden_stories[ONCE]
    seq = [g["prompt_tokens"] + g["generated_tokens"]]
    with meta.cache.hold(), gen.cache.hold():
        ref, ours = meta.runner.logits(seq)[0], gen.runner.logits(seq)[0]
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()
    q8 = write_meta_gguf(tmp_path / "q8.gguf", state, params, STORIES / "tokenizer.model", quant="Q8_0")
    gen8 = Llama.build(str(q8), None, max_seq_len=256, max_batch_size=2, compile=False)
    with gen8.cache.hold():
        low = gen8.runner.logits(seq)[0]
    agree = (low.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.95 and (low - ref).abs().max() < 0.5, (agree, (low - ref).abs().max())



@HOST_MEMORY
def test_a_bf16_gguf_loads_in_place_to_the_logits_of_the_same_weights_from_meta(goldens, tmp_path):
    """BF16 tensors loaded as bf16 are the file's own bytes (memory-mapped, no copy: a 7B bf16 file loads in
    seconds), and give the logits of the Meta checkpoint cast to bf16, exactly."""
    import torch
    from conftest import STORIES
    from helpers import ONCE, write_meta_gguf

    from llama.loading import preload

    if not preload.file_mappings():
        pytest.skip("needs /proc/self/maps (Linux) to see where the weights live")
    state = torch.load(need(STORIES / "consolidated.00.pth"), map_location="cpu")
    params = json.loads((STORIES / "params.json").read_text())
    path = write_meta_gguf(tmp_path / "bf16.gguf", state, params, STORIES / "tokenizer.model", quant="BF16")
    kw = dict(max_seq_len=256, max_batch_size=1, compile=False, dtype="bfloat16", preload=False)
    meta = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), **kw)
    gen = Llama.build(str(path), None, **kw)
    in_file = [s.data_ptr() for s in preload.mapped_storages([*gen.model.parameters()], preload.file_mappings())]
    wo = gen.model.layers[0].attention.wo.weight
    assert wo.untyped_storage().data_ptr() in in_file, "the bf16 weight was copied"
    g = goldens[ONCE]
    seq = [g["prompt_tokens"] + g["generated_tokens"]]
    with meta.cache.hold(), gen.cache.hold():
        ref, ours = meta.runner.logits(seq)[0], gen.runner.logits(seq)[0]
    assert torch.equal(ours, ref), (ours - ref).abs().max()


# ------------------------------------------------------------------------------------------------- quantized loading
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_load_streams_layer_by_layer_to_the_same_weights_as_quantizing_after(smol, golden, scheme):
    """quantize= quantizes each layer as it is read: the weights equal quantizing the model after a full load (in
    the activation dtype the scheme loads with), so greedy decoding equals quantizing after, token for token; against
    the fp32 golden, int8's teacher-forced argmaxes agree at 63 of 64 positions (the other is an exact tie of two
    bf16 logits, 17.5 and 17.5), int4's at 48 or more (55 measured)."""
    import torch

    from llama.quantization import schemes
    q = Llama.build(str(GGUF), None, max_seq_len=256, max_batch_size=1, compile=False, quantize=scheme)
    dtype = schemes.activation_dtype(scheme) or torch.float32
    with dequantizing():
        ref = Llama.build(str(GGUF), None, max_seq_len=256, max_batch_size=1, compile=False, dtype=dtype)
    schemes.quantize(ref.model, scheme)
    ours, theirs = dict(q.model.named_parameters()), dict(ref.model.named_parameters())
    assert ours.keys() == theirs.keys() and any(p.dtype in (torch.int8, torch.uint8) for p in ours.values())
    for name, p in ours.items():
        assert p.dtype == theirs[name].dtype and torch.equal(p, theirs[name]), name
    g = golden["prompts"]["Once upon a time"]
    if scheme == "int8":
        # Greedy text is no fp32 check: one decode step at index 4 is a near tie that decoding one token at a time
        # breaks the other way from the teacher-forced pass (1315 for the golden's 23324), after which the other 15 tokens are the golden's again.
        ids = q.generate([g["prompt_tokens"]], max_gen_len=16, temperature=0)[0][0]
        assert ids == ref.generate([g["prompt_tokens"]], max_gen_len=16, temperature=0)[0][0]
    seq, n = g["prompt_tokens"] + g["generated_tokens"], len(g["generated_tokens"])
    logits = q.model(torch.tensor([seq]), 0)[0, -n - 1 : -1]
    agree = (logits.argmax(-1) == torch.tensor(g["generated_tokens"])).sum().item()
    # (4 bits diverge from fp32's greedy text within a few tokens, so int4 is checked teacher-forced only). On a CPU
    # without AVX-512 BF16 (the 2-core AVX2 EPYC, 2026-11-28, before and after issue 48's changes) one more
    # position flips: 62 of 64, where an AVX-512 BF16 CPU gives 63.
    from llama.kernels import cpu
    int8_floor = n - 1 if "avx512_bf16" in cpu.cpu_flags() else n - 2
    assert agree >= {"int8": int8_floor, "int4": 48}[scheme], f"{agree} of {n}"


PEAK_PROBE = """
import json, sys
from llama import Llama
hwm = lambda: int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
base = hwm()
g = Llama.build(sys.argv[1], None, max_seq_len=16, max_batch_size=1, compile=False, dtype="bfloat16",
                quantize=None if sys.argv[2] == "none" else sys.argv[2])
print(json.dumps({"peak": hwm() - base}))
"""


@HOST_MEMORY
def test_a_quantized_load_of_a_q8_0_file_peaks_below_a_bf16_load(stories_dir, tmp_path):
    """Reading layer by layer (file pages and temporaries released as it goes) keeps an int8 load's peak RSS well
    under a bf16 load of the same file: a whole-model bf16 detour would put it above the bf16 load (bf16 weights plus
    the int8 copy), while streaming keeps it below by a good part of the ~half the bytes int8 saves (the margin
    leaves room for file pages and allocator slack, which vary between machines). (A small vocabulary, so the layers
    are most of the model.)"""
    import subprocess
    import sys

    from helpers import write_meta_gguf

    from llama.hub.demo import random_state_dict
    from llama.model import ModelArgs

    params = {"dim": 1024, "n_layers": 12, "n_heads": 16, "multiple_of": 256, "norm_eps": 1e-5, "vocab_size": 512}
    state = random_state_dict(ModelArgs.from_params(params), seed=0)
    bf16_bytes = 2 * sum(t.numel() for t in state.values())
    path = write_meta_gguf(tmp_path / "q8.gguf", state, params, stories_dir / "tokenizer.model", quant="Q8_0")
    del state
    peaks = {}
    for q in ("none", "int8"):
        out = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(path), q], capture_output=True, text=True,
                             env={**rank_env(1), "LLAMA_GGUF_BLOCKS": "0"}, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks[q] = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    assert peaks["int8"] < peaks["none"] - 0.1 * bf16_bytes, (peaks, bf16_bytes)


def test_logits_match_transformers_on_the_same_gguf_within_1e_3(smol, golden):
    """Hugging Face transformers reading the same file (its own GGUF loader, fp32) as an independent reference:
    every position's logits of each golden prompt + continuation agree within 1e-3."""
    import torch

    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    transformers = pytest.importorskip("transformers")
    with transformers_reading_gguf():
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                                      torch_dtype=torch.float32)
    for g in golden["prompts"].values():
        seq = g["prompt_tokens"] + g["generated_tokens"]
        with torch.no_grad():
            ref = ref_model(torch.tensor([seq])).logits[0]
        with smol.cache.hold():
            ours = smol.runner.logits([seq])[0].cpu()
        assert (ours - ref).abs().max() < 1e-3, (ours - ref).abs().max()
