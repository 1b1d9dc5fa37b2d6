"""GGUF `llama4` files as llama.cpp makes them: a tiny random Llama4ForCausalLM written by transformers (a dense and
an MoE layer in turn, 4 experts top-1 with the shared expert, L2 qk-norm, every 4th layer NoPE, Scout's stepped
rope scaling as llama.cpp's rope_freqs tensor; the NoPE layer's queries sharpened), converted by llama.cpp's convert_hf_to_gguf.py to f32 and to Q8_0.
The file carries no chunk size, NoPE interval or temperature: llama.cpp fixes them (8192, 4, floor 8192 and 0.1),
and the model is built with those, so transformers' config takes the same. The f32 file gives transformers' logits
and llama.cpp's argmaxes; the Q8_0 file runs in its blocks (the experts' included) close to the f32 one."""

import subprocess
import types

import hardware
import numpy as np
import peers
import pytest
import torch
from families import VOCAB, converter_command, our_logits, sequence, write_byte_level_tokenizer

from llama import Llama
from llama.formats import architectures, gguf_file, gguf_quants
from llama.quantization import gguf_blocks

transformers = pytest.importorskip("transformers")
N_LAYERS, N_EXPERTS = 4, 4


def hf_model(seed: int = 0):
    """Llama4ForCausalLM with llama.cpp's fixed chunk (8192), NoPE step (4) and temperature (8192, 0.1)."""
    torch.manual_seed(seed)
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96, num_hidden_layers=N_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=N_EXPERTS, num_experts_per_tok=1,
        interleave_moe_layer_step=2, use_qk_norm=True, no_rope_layer_interval=4, attention_chunk_size=8192,
        attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["Llama4ForCausalLM"]
    model = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():  # the norms' weights away from 1, so a misplaced norm shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
        model.model.layers[3].self_attn.q_proj.weight.mul_(8.0)  # the NoPE layer's scores sharp: the temperature shows
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(transformers model, f32 file, Q8_0 file): the two conversions run side by side."""
    d = tmp_path_factory.mktemp("llama4") / "hf"
    model = hf_model()
    model.save_pretrained(d)
    write_byte_level_tokenizer(d)
    command = converter_command(peers.llama_cpp_tree() / "convert_hf_to_gguf.py", d, bpe=True)
    outs = {kind: d.parent / f"llama4.{kind}.gguf" for kind in ("f32", "q8_0")}
    procs = [subprocess.Popen([*command, "--outtype", kind, "--outfile", str(out)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for kind, out in outs.items()]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    return model, outs["f32"], outs["q8_0"]


def build(path, **options):
    return Llama.build(str(path), None, max_seq_len=128, max_batch_size=3, compile=False, dtype=torch.float32,
                       **options)


def test_the_file_s_llama4_loads_to_transformers_logits(files):
    """60 positions: fp32 logits within 1e-4 of transformers', with the ModelArgs llama.cpp's graph computes."""
    model, f32, _ = files
    g = build(f32)
    args = g.model.params
    assert (args.attention_chunk_size, args.nope_layer_interval, args.qk_l2_norm, args.attn_temperature_tuning,
            args.floor_scale, args.attn_scale) == (8192, 4, True, True, 8192.0, 0.1)
    assert (args.moe.router, args.moe.scale_inputs, args.moe.shared_expert, args.moe.renormalize, args.moe.every) \
        == ("sigmoid", True, True, False, 2)
    assert [args.moe.is_moe(i) for i in range(N_LAYERS)] == [False, True, False, True]
    assert args.rope_scaling["rope_type"] == "factors"
    seq = sequence(60)
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0]
    assert (our_logits(g, seq) - ref).abs().max() < 1e-4 * max(1.0, float(ref.abs().max()))


def test_past_the_chunk_and_the_temperature_floor_the_logits_stay_transformers(files):
    """8200 positions (past llama.cpp's fixed chunk of 8192 and the temperature floor of 8192): the last 16
    positions' logits, where the RoPE layers see only the new chunk and the NoPE layers' queries are scaled
    (measured: without the chunk they are 0.49 apart, without the temperature 1.2e-3)."""
    model, f32, _ = files
    seq = sequence(8200)
    model.config._attn_implementation = "sdpa"  # eager's (T, T) weights per head would take gigabytes
    try:
        with torch.no_grad():
            ref = model(torch.tensor([seq]), logits_to_keep=16).logits[0]
    finally:
        model.config._attn_implementation = "eager"
    g = Llama.build(str(f32), None, max_seq_len=8208, max_batch_size=1, compile=False, dtype=torch.float32)
    assert (our_logits(g, seq)[-16:] - ref).abs().max() < 1e-4 * max(1.0, float(ref.abs().max()))


def test_argmaxes_agree_with_llama_cpp_on_the_same_file(files):
    """llama.cpp's own llama4 graph on the f32 file (its KV cache in fp16): the argmaxes of 60 positions agree and
    the logits differ by 5.7e-3 at most (measured: its fp16 cache under the NoPE layer's sharp scores; bound 2e-2)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    _, f32, _ = files
    seq = sequence(60)
    ours = our_logits(build(f32), seq)
    lc = llama_cpp.Llama(str(f32), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    lc.eval(seq)
    ref = torch.tensor(np.array(lc.scores[: len(seq)]))
    assert float((ours.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.95
    assert (ours - ref).abs().max() < 2e-2 * max(1.0, float(ref.abs().max()))


def test_greedy_ids_alone_equal_batched(files):
    _, f32, _ = files
    g = build(f32)
    prompts = [sequence(40, seed=2), sequence(11, seed=3), sequence(25, seed=4)]
    alone = [g.generate([p], max_gen_len=16, temperature=0)[0][0] for p in prompts]
    assert g.generate(prompts, max_gen_len=16, temperature=0)[0] == alone


@hardware.KERNELS
def test_q8_0_runs_in_its_blocks_close_to_f32(files):
    """Every linear layer of the Q8_0 file (each expert, the shared expert, attention, the dense FFN) runs in its
    Q8_0 blocks; the logits stay close to the f32 file's (measured: 0.009 apart at most, every argmax equal)."""
    _, f32, q8 = files
    g = build(q8)
    ffn = [layer.feed_forward for layer in g.model.layers]
    experts = [e for f in ffn if hasattr(f, "experts") for e in [*f.experts, f.shared_expert]]
    assert len(experts) == 2 * (N_EXPERTS + 1)
    assert all(isinstance(lin.method, gguf_blocks.GGUFBlocks) for e in experts for lin in (e.w13 or e.w1, e.w2)), \
        "an expert is not running in its blocks"
    kinds = gguf_quants.summary(g.model)
    assert kinds.get("Q8_0", 0) >= len(experts) + N_LAYERS, kinds  # and each layer's attention
    seq = sequence(60)
    ref, got = our_logits(build(f32), seq), our_logits(g, seq)
    assert (got - ref).abs().max() < 2e-2 * max(1.0, float(ref.abs().max()))
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def _with(reader, **fields):
    """reader with llama4.<key> metadata fields added or replaced (each field's contents() the value)."""
    for key, value in fields.items():
        reader.fields[f"llama4.{key.replace('__', '.')}"] = types.SimpleNamespace(contents=lambda v=value: v)
    return reader


@pytest.mark.parametrize("fields, message", [
    ({"attention__sliding_window": 0}, r"llama4\.attention\.sliding_window 0 .*not supported"),
    ({"attention__sliding_window_pattern": 2}, r"sliding_window_pattern 2 is not every 4th layer global"),
    ({"rope__freq_base_swa": 10000.0}, r"freq_base_swa 10000 differs"),
    ({"attention__scale": 0.5}, r"llama4\.attention\.scale 0\.5 is not supported"),
    ({"expert_count": 0}, r"without llama4\.expert_count .* not supported"),
    ({"expert_weights_scale": 2.5}, r"expert_weights_scale 2\.5 is not supported"),
])
def test_what_llama4_does_not_compute_is_refused_naming_the_key(files, fields, message):
    _, f32, _ = files
    reader = _with(gguf_file.open_reader(f32), **fields)
    with pytest.raises(ValueError, match=message):
        architectures.read_params(reader, f32)


def test_the_pattern_of_llama4_itself_is_accepted(files):
    _, f32, _ = files
    reader = _with(gguf_file.open_reader(f32), attention__sliding_window_pattern=4, attention__sliding_window=8192)
    assert architectures.read_params(reader, f32)["nope_layer_interval"] == 4
