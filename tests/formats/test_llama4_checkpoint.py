"""Llama 4's text model (llama/formats/llama4.py, llama/model.py IRoPEAttention, llama/moe.py's sigmoid router and
shared expert) on tiny random configurations of the Scout shape (every layer MoE, 16 experts top-1, L2 qk-norm,
Scout's scaled rope) and the Maverick shape (MoE every 2nd layer, 128 experts cut to 8, no qk-norm): fp32 logits
and greedy ids equal to Meta's reference (llama-models' llama4 Transformer, run on the CPU by
tests/llama4_reference.py, patched in this process only) and to transformers' Llama4ForCausalLM, alone, batched,
through the engine, with speculation and at model-parallel size 2. Chunks of 16 positions and a temperature floor
of 8 positions, so prompts cross both."""

import json
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import CPU_SPECULATION, STORIES, need, rank_env

from llama import Llama
from llama.formats import llama4
from llama4_reference import N, SHAPES, meta_files, meta_greedy, meta_logits, meta_reference

pytest.importorskip("llama_models", reason="llama-models (Meta's reference code) is a test dependency")


def hf_reference(args, state):
    """transformers' Llama4ForCausalLM with our model's weights (renamed back to its layout)."""
    transformers = pytest.importorskip("transformers")
    moe = args.moe
    config = transformers.Llama4TextConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=moe.hidden_dim,
        intermediate_size_mlp=args.hidden_dim, num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, rms_norm_eps=args.norm_eps,
        num_local_experts=moe.n_experts, num_experts_per_tok=moe.top_k, interleave_moe_layer_step=moe.every,
        use_qk_norm=args.qk_l2_norm, no_rope_layer_interval=args.nope_layer_interval,
        attention_chunk_size=args.attention_chunk_size, attn_temperature_tuning=args.attn_temperature_tuning,
        floor_scale=int(args.floor_scale), attn_scale=args.attn_scale, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": 16.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192} if args.rope_scaling else
        {"rope_type": "default", "rope_theta": args.rope_theta})
    config._attn_implementation = "eager"
    model = transformers.Llama4ForCausalLM(config).eval()
    model.load_state_dict(to_hf(state, args), strict=True)
    return model


def to_hf(state, args) -> dict:
    names = {v: k for k, v in llama4._HF_LAYER.items()}
    out = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"],
           "lm_head.weight": state["output.weight"]}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        for name, t in state.items():
            local = name[len(p):-len(".weight")] if name.startswith(p) else None
            if local in names:
                out[f"model.layers.{i}.{names[local]}.weight"] = t
        if args.moe.is_moe(i):
            e = range(args.moe.n_experts)
            w = lambda k: torch.stack([state[f"{p}feed_forward.experts.{j}.{k}.weight"].t() for j in e])  # noqa: E731
            out[f"model.layers.{i}.feed_forward.experts.gate_up_proj"] = torch.cat([w("w1"), w("w3")], dim=-1)
            out[f"model.layers.{i}.feed_forward.experts.down_proj"] = w("w2")
    return out


_BUILT: dict = {}


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request, tmp_path_factory):
    """(name, Meta's reference model, its checkpoint directory, our generator, prompts)."""
    return built(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def maverick(tmp_path_factory):
    """The Maverick shape alone (dense and MoE layers): built once with shape's."""
    return built("maverick", tmp_path_factory)


def built(name, tmp_path_factory):
    if name not in _BUILT:
        _BUILT[name] = build_shape(name, tmp_path_factory)
    return _BUILT[name]


def build_shape(name, tmp_path_factory):
    need(STORIES)
    params = SHAPES[name]
    ref = meta_reference(params, seed=1 if name == "scout" else 2)
    d = tmp_path_factory.mktemp(name)
    torch.save(ref.state_dict(), d / "consolidated.00.pth")
    (d / "params.json").write_text(json.dumps(params))
    gen = Llama.build(str(d), str(STORIES / "tokenizer.model"), max_seq_len=128, max_batch_size=3)
    gen.tokenizer.stop_tokens = {}  # random weights: the reference never stops either
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (45, 9, 30)]
    return name, ref, d, gen, prompts


def test_logits_equal_metas_reference_and_transformers(shape):
    name, ref, d, gen, prompts = shape
    args = gen.model.params
    assert args.moe.n_experts == (16 if name == "scout" else 8) and args.qk_l2_norm == (name == "scout")
    assert [args.moe.is_moe(i) for i in range(4)] == ([True] * 4 if name == "scout" else [False, True] * 2)
    want = meta_logits(ref, prompts[0])
    with torch.no_grad():
        got = gen.model(torch.tensor([prompts[0]]), 0)[0]
        state = {k: v for k, v in gen.model.state_dict().items()}
        hf = hf_reference(args, state)(torch.tensor([prompts[0]])).logits[0]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    torch.testing.assert_close(hf, want, rtol=0, atol=2e-5)
    assert (want[40] - meta_logits(ref, prompts[0][32:41])[-1]).abs().max() > 1e-3  # NoPE layers see all


@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_ids_alone_batched_and_through_the_engine(shape, speculative):
    name, ref, d, gen, prompts = shape
    want = [meta_greedy(ref, p) for p in prompts]
    if not speculative:
        alone = [gen.generate([p], max_gen_len=N, temperature=0)[0][0] for p in prompts]
        batched = gen.generate(prompts, max_gen_len=N, temperature=0)[0]
        with gen.engine(prefill_chunk=7) as engine:  # prompts prefilled in pieces across chunk borders
            reqs = [engine.submit(p, max_gen_len=N, temperature=0) for p in prompts]
            engine_ids = [r.result(timeout=300) and r.generated for r in reqs]
        assert alone == want and batched == want and engine_ids == want
        return
    if CPU_SPECULATION.args[0]:
        pytest.skip(CPU_SPECULATION.kwargs["reason"])
    spec = Llama.build(str(d), str(STORIES / "tokenizer.model"), max_seq_len=128, max_batch_size=3,
                       draft_model=str(d), compile=False)  # its own drafts: every draft accepted, verified in rows
    spec.tokenizer.stop_tokens = {}
    with spec.engine() as engine:
        reqs = [engine.submit(p, max_gen_len=N, temperature=0) for p in prompts]
        assert [r.result(timeout=300) and r.generated for r in reqs] == want


MP_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from llama import Llama
torch.set_num_threads(1)
tokenizer, out, prompts, *dirs = sys.argv[1:]
res = {}
for d in dirs:
    g = Llama.build(d, tokenizer, max_seq_len=128, max_batch_size=3, device="cpu")
    g.tokenizer.stop_tokens = {}
    res[d] = g.generate(json.loads(prompts), max_gen_len=%d, temperature=0)[0]
if dist.get_rank() == 0:
    json.dump(res, open(out, "w"))
dist.barrier()
dist.destroy_process_group()
""" % N


def test_metas_file_layout_in_two_shards_at_model_parallel_size_1_and_2(maverick, tmp_path):
    """Meta's files (flattened experts, fused wqkv / fc1, per-rank cuts) in two shards: one process merges them,
    and torchrun's two gloo ranks load them and the one-shard checkpoint: Meta's greedy ids every time (one launch,
    on the Maverick shape: dense and MoE layers)."""
    name, ref, d, gen, prompts = maverick
    two = tmp_path / "two"
    two.mkdir()
    params = json.loads((d / "params.json").read_text())
    for k, s in enumerate(meta_files(ref.state_dict(), params, 2)):
        torch.save(s, two / f"consolidated.{k:02d}.pth")
    (two / "params.json").write_text(json.dumps(params))
    want = [meta_greedy(ref, p) for p in prompts]
    merged = Llama.build(str(two), str(STORIES / "tokenizer.model"), max_seq_len=128, max_batch_size=3)
    merged.tokenizer.stop_tokens = {}
    assert merged.generate(prompts, max_gen_len=N, temperature=0)[0] == want
    (tmp_path / "run.py").write_text(MP_SCRIPT)
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(tmp_path / "run.py"), str(STORIES / "tokenizer.model"), str(out), json.dumps(prompts),
                           str(d), str(two)], env=rank_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res[str(d)] == want and res[str(two)] == want


def test_a_hugging_face_directory_loads_to_the_same_logits(shape, tmp_path):
    name, ref, d, gen, prompts = shape
    hf = hf_reference(gen.model.params, gen.model.state_dict())
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = Llama.build(str(tmp_path), str(STORIES / "tokenizer.model"), max_seq_len=128, max_batch_size=1)
    with torch.no_grad():
        torch.testing.assert_close(ours.model(torch.tensor([prompts[0]]), 0)[0], meta_logits(ref, prompts[0]),
                                   rtol=0, atol=2e-5)


def test_vision_is_skipped_naming_it_and_fp8_weights_are_refused(shape, tmp_path):
    name, ref, d, gen, prompts = shape
    params = {**json.loads((d / "params.json").read_text()), "vision_args": {"dim": 8}}
    state = {**torch.load(d / "consolidated.00.pth"), "vision_projection.weight": torch.zeros(64, 8)}
    torch.save(state, tmp_path / "consolidated.00.pth")
    (tmp_path / "params.json").write_text(json.dumps(params))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = Llama.build(str(tmp_path), str(STORIES / "tokenizer.model"), max_seq_len=64, max_batch_size=1)
    assert any("image encoder" in str(w.message) for w in caught)
    with torch.no_grad():
        torch.testing.assert_close(g.model(torch.tensor([prompts[1]]), 0)[0], meta_logits(ref, prompts[1]),
                                   rtol=0, atol=2e-5)
    expert = next(n for n in state if n.endswith("experts.w1"))
    state[expert] = state[expert].to(torch.float8_e4m3fn)
    torch.save(state, tmp_path / "consolidated.00.pth")
    with pytest.raises(ValueError, match="FP8"):
        Llama.build(str(tmp_path), str(STORIES / "tokenizer.model"), max_seq_len=64, max_batch_size=1)
    params["moe_args"]["group_size"] = 4
    (tmp_path / "params.json").write_text(json.dumps(params))
    with pytest.raises(ValueError, match="'moe_args': unknown key"):
        Llama.build(str(tmp_path), str(STORIES / "tokenizer.model"), max_seq_len=64, max_batch_size=1)


@pytest.mark.parametrize("mode", ["on", "exact"])
def test_prefix_cached_suffixes_attend_within_their_chunks(shape, mode):
    """A prompt that continues another's output reuses its cached blocks (chunks and NoPE layers over the cached
    keys): Meta's ids, with the cache on and under prefix_cache="exact" (each query alone over its keys)."""
    name, ref, d, gen, prompts = shape
    g = Llama.build(str(d), str(STORIES / "tokenizer.model"), max_seq_len=128, max_batch_size=2, prefix_cache=mode,
                    compile=False)
    g.tokenizer.stop_tokens = {}
    first = prompts[0] + meta_greedy(ref, prompts[0])
    longer = first + prompts[1]
    with g.engine(prefill_chunk=16) as engine:
        assert engine.submit(prompts[0], max_gen_len=N, temperature=0).result(timeout=300) is not None
        request = engine.submit(longer, max_gen_len=N, temperature=0)
        request.result(timeout=300)
    assert g.cache.pool.stats["cached_tokens"] > 0, g.cache.pool.stats
    assert request.generated == meta_greedy(ref, longer)
