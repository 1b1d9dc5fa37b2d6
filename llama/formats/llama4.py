"""Llama 4 (Scout, Maverick) text weights in Meta's and Hugging Face's layouts, read into ModelArgs and our names.

Meta's params.json (llama_models/llama4/args.py) carries moe_args and the iRoPE fields; its shards name an MoE
layer's experts as 3-D tensors (the model's own state_dict: experts.w1 (E, D, F), or the files' flattened
moe_w_in_eD_F (E*D, F), moe_w_swiglu_eD_F, moe_w_out_eF_D (E*F, D), F split across shards), the router as
router_DE (D, E) and the shared expert as shared_expert.w1/w2/w3 (or w_in_shared_FD, w_swiglu_FD, w_out_shared_DF);
fused attention.wqkv and feed_forward.mlp.fc1_weight hold each shard's q/k/v rows and w1/w3 rows. Each shard is
renamed into our names (llama/moe.py: feed_forward.experts.E.w1/w2/w3, feed_forward.gate, feed_forward.shared_expert)
as views of the memory-mapped files, so the shard machinery of meta_checkpoint.py cuts them at any world size.

Hugging Face's Llama4ForCausalLM (and the text model of Llama4ForConditionalGeneration) keeps Meta's interleaved
rotary order (no q/k permutation); its experts are gate_up_proj (E, D, 2F) and down_proj (E, F, D).

The image encoder is not implemented: vision_args, and the vision weights of either layout, are skipped with a
warning naming it; the text model loads.
"""

import re
import warnings
from typing import Dict, Optional

import torch

from llama.rope import scaled_rope_args
from llama.model_args import ModelArgs

MOE_KEYS = ("num_experts", "capacity_factor", "auto_scale_F", "top_k", "interleave_moe_layer_step")
VISION = "the Llama 4 image encoder (vision_args / vision weights) is not implemented: the text model loads " \
         "without it, and image inputs are refused"
# Meta's params.json keys taken as they are (the rest are derived below)
_SAME = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier", "norm_eps",
         "rope_theta", "attention_chunk_size", "nope_layer_interval", "attn_temperature_tuning", "floor_scale",
         "attn_scale", "max_batch_size", "max_seq_len")


def is_llama4(args: ModelArgs) -> bool:
    """Whether args describe Llama 4's MoE layers (a sigmoid router scaling the experts' inputs, a shared expert)."""
    return args.moe is not None and args.moe.shared_expert and args.moe.scale_inputs


def moe_hidden(dim: int, ffn_exp: float, ffn_dim_multiplier: float, multiple_of: int, moe: dict) -> int:
    """An expert's hidden size by Meta's rule (llama_models/llama4/moe.py MoE.__init__)."""
    hidden = int(2 * int(ffn_exp * dim) / 3)
    hidden = int(ffn_dim_multiplier * hidden)
    if moe.get("auto_scale_F", True):
        hidden = int(hidden / (moe.get("capacity_factor", 1.0) + 1))
    return hidden + (-hidden % multiple_of)


def meta_params(params: dict, path) -> dict:
    """ModelArgs keyword arguments from Meta's Llama 4 params.json (ValueError naming what cannot be computed)."""
    if params.get("vision_args") is not None:
        warnings.warn(f"{path}: {VISION}", stacklevel=3)
    moe = params.get("moe_args")
    if not isinstance(moe, dict):
        raise ValueError(f"{path} has 'vision_args' without 'moe_args': not a Llama 4 text model, which this Llama "
                         "implementation cannot compute")
    unknown = sorted(set(moe) - set(MOE_KEYS))
    if unknown:
        raise ValueError(f"{path} has 'moe_args': unknown key(s) {', '.join(unknown)} (known: {', '.join(MOE_KEYS)}), "
                         "which this Llama implementation cannot compute")
    if params.get("ffn_exp") is None or params.get("ffn_dim_multiplier") is None:
        raise ValueError(f"{path}: a Llama 4 params.json needs ffn_exp and ffn_dim_multiplier (the experts' size)")
    out = {k: params[k] for k in _SAME if k in params}
    out.setdefault("rope_theta", 500000.0)  # Meta's Llama 4 default
    dim, n_heads = params.get("dim"), params.get("n_heads")
    if params.get("head_dim") is not None and isinstance(dim, int) and isinstance(n_heads, int) \
            and params["head_dim"] != dim // n_heads:
        raise ValueError(f"{path}: head_dim ({params['head_dim']}) must be dim // n_heads ({dim // n_heads}): "
                         "Meta's Llama 4 attention takes that")
    multiple_of = params.get("multiple_of", 256)
    out["moe"] = {"n_experts": int(moe.get("num_experts", -1)), "top_k": int(moe.get("top_k", 1)),
                  "hidden_dim": moe_hidden(dim, params["ffn_exp"], params["ffn_dim_multiplier"], multiple_of, moe),
                  "renormalize": False, "router": "sigmoid", "every": int(moe.get("interleave_moe_layer_step", 1)),
                  "scale_inputs": True, "shared_expert": True}
    out["qk_l2_norm"] = bool(params.get("use_qk_norm", False))
    if params.get("use_scaled_rope"):
        factor, high = params.get("rope_scaling_factor") or 16, params.get("rope_high_freq_factor") or 1
        out.update(scaled_rope_args(out["rope_theta"], dim // n_heads, factor, 1.0, high, 8192))
    return out


def _experts(prefix: str, w: str, t: torch.Tensor, n_experts: int, dim: int, inner: bool) -> Dict[str, torch.Tensor]:
    """Per-expert (out, in) views of a 3-D (or flattened) expert tensor: inner: (E, D, F) -> (F, D); else
    (E, F, D) -> (D, F)."""
    t = t.view(n_experts, dim, -1) if inner else t.view(n_experts, -1, dim)
    return {f"{prefix}feed_forward.experts.{e}.{w}.weight": t[e].t() for e in range(n_experts)}


_SHARED = {"w_in_shared_FD.weight": "w1", "w_swiglu_FD.weight": "w3", "w_out_shared_DF.weight": "w2"}
_DROPPED = ("._extra_state", "feed_forward.global_gate_stats_3E", "feed_forward.expert_activation_DE")
_NORMS = {"attention.wqkv.layer_norm_weight": "attention_norm.weight", "feed_forward.norm.weight": "ffn_norm.weight",
          "feed_forward.mlp.layer_norm_weight": "ffn_norm.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def meta_layer(prefix: str, local: str, t: torch.Tensor, args: ModelArgs) -> Dict[str, torch.Tensor]:
    """Our tensors of one Meta layer tensor layers.N.<local> of one shard (views; {} for ones the model has no use
    for; names already ours pass unchanged)."""
    E, D = args.moe.n_experts, args.dim
    if any(local.endswith(d) for d in _DROPPED):
        return {}
    if local in _NORMS:
        return {prefix + _NORMS[local]: t}
    if local == "attention.wqkv.weight":
        heads = args.n_heads + 2 * args.n_kv_heads
        q, kv = t.shape[0] * args.n_heads // heads, t.shape[0] * args.n_kv_heads // heads
        return {prefix + f"attention.{n}.weight": p for n, p in zip(("wq", "wk", "wv"), t.split([q, kv, kv]))}
    if local == "feed_forward.mlp.fc1_weight":
        w1, w3 = t.chunk(2)
        return {prefix + "feed_forward.w1.weight": w1, prefix + "feed_forward.w3.weight": w3}
    if local == "feed_forward.mlp.fc2_weight":
        return {prefix + "feed_forward.w2.weight": t}
    if local == "feed_forward.router_DE":
        return {prefix + "feed_forward.gate.weight": t.t()}
    for names, w, inner in ((("moe_w_in_eD_F", "w1"), "w1", True), (("moe_w_swiglu_eD_F", "w3"), "w3", True),
                            (("moe_w_out_eF_D", "w2"), "w2", False)):
        if local in tuple(f"feed_forward.experts.{n}" for n in names):
            return _experts(prefix, w, t, E, D, inner)
    shared = local[len("feed_forward."):] if local.startswith("feed_forward.") else None
    if shared in _SHARED:
        return {f"{prefix}feed_forward.shared_expert.{_SHARED[shared]}.weight": t}
    return {prefix + local: t}


def meta_shard(state: Dict[str, torch.Tensor], args: ModelArgs, path) -> Dict[str, torch.Tensor]:
    """One shard of a Meta Llama 4 checkpoint in our names (vision weights skipped with a warning)."""
    out, vision = {}, False
    for name, t in state.items():
        if name.startswith(("vision_embeddings.", "vision_projection.")):
            vision = True
            continue
        m = _LAYER.match(name)
        out.update(meta_layer(f"layers.{m.group(1)}.", m.group(2), t, args) if m else {name: t})
    if vision:
        warnings.warn(f"{path}: vision weights skipped: {VISION}", stacklevel=3)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face


def hf_text_config(config: dict, source) -> dict:
    """The text model's config of Llama4ForCausalLM (itself) or Llama4ForConditionalGeneration (text_config)."""
    if "text_config" in config:
        if config.get("vision_config") is not None:
            warnings.warn(f"{source}: {VISION}", stacklevel=3)
        return config["text_config"]
    return config


def _interval(flags, n_layers: int, source) -> Optional[int]:
    """nope_layer_interval of HF's no_rope_layers (1: the layer rotates), ValueError for another pattern."""
    nope = [i for i, f in enumerate(flags) if not f]
    if not nope:
        return None
    interval = nope[0] + 1
    if nope != list(range(interval - 1, n_layers, interval)):
        raise ValueError(f"{source}: no_rope_layers {list(flags)} is not every n-th layer, which this Llama "
                         "implementation cannot compute")
    return interval


def hf_params(config: dict, source) -> dict:
    """ModelArgs keyword arguments from a Llama 4 config.json."""
    c = hf_text_config(config, source)
    try:
        dim, n_heads, layers = int(c["hidden_size"]), int(c["num_attention_heads"]), int(c["num_hidden_layers"])
        params = {"dim": dim, "n_layers": layers, "n_heads": n_heads, "vocab_size": int(c["vocab_size"]),
                  "n_kv_heads": int(c.get("num_key_value_heads") or n_heads),
                  "head_dim": int(c.get("head_dim") or dim // n_heads), "hidden_dim": int(c["intermediate_size_mlp"]),
                  "norm_eps": float(c.get("rms_norm_eps", 1e-5)), "qk_l2_norm": bool(c.get("use_qk_norm", True)),
                  "attn_temperature_tuning": bool(c.get("attn_temperature_tuning", True)),
                  "floor_scale": float(c.get("floor_scale", 8192)), "attn_scale": float(c.get("attn_scale", 0.1))}
        moe_layers = c.get("moe_layers")
        step = int(c.get("interleave_moe_layer_step", 1))
        if moe_layers is None:
            moe_layers = list(range(step - 1, layers, step))
        dense = [i for i in range(layers) if i not in set(moe_layers)]
        params["moe"] = {"n_experts": int(c["num_local_experts"]), "top_k": int(c.get("num_experts_per_tok", 1)),
                         "hidden_dim": int(c["intermediate_size"]), "renormalize": False, "router": "sigmoid",
                         "dense_layers": dense, "scale_inputs": True, "shared_expert": True}
        flags = c.get("no_rope_layers") or [int((i + 1) % int(c.get("no_rope_layer_interval", 4)) != 0)
                                            for i in range(layers)]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source} lacks {e.args[0]!r}") from None
    params["nope_layer_interval"] = _interval(flags, layers, source)
    if c.get("attention_chunk_size") is not None:
        params["attention_chunk_size"] = int(c["attention_chunk_size"])
    if c.get("hidden_act", "silu") != "silu" or c.get("attention_bias"):
        raise ValueError(f"{source}: hidden_act other than silu or attention_bias is not Llama 4's")
    params.update(hf_rope(c, params["head_dim"], source))
    return params


def hf_rope(c: dict, head_dim: int, source) -> dict:
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", c.get("rope_theta", 500000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "llama3":
        raise ValueError(f"{source}: rope_type {kind!r} is not Llama 4's (default or llama3)")
    return {"rope_theta": theta, **scaled_rope_args(theta, head_dim, rope["factor"], rope["low_freq_factor"],
                                                     rope["high_freq_factor"],
                                                     int(rope["original_max_position_embeddings"]))}


_HF_LAYER = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "input_layernorm": "attention_norm",
             "post_attention_layernorm": "ffn_norm", "feed_forward.gate_proj": "feed_forward.w1",
             "feed_forward.up_proj": "feed_forward.w3", "feed_forward.down_proj": "feed_forward.w2",
             "feed_forward.router": "feed_forward.gate",
             "feed_forward.shared_expert.gate_proj": "feed_forward.shared_expert.w1",
             "feed_forward.shared_expert.up_proj": "feed_forward.shared_expert.w3",
             "feed_forward.shared_expert.down_proj": "feed_forward.shared_expert.w2"}
_HF_GLOBAL = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight"}


def hf_to_meta(hf: Dict[str, torch.Tensor], args: ModelArgs, dtype=None, tied: bool = False, source="") -> dict:
    """Our names of a Llama 4 Hugging Face state dict (vision weights skipped with a warning)."""
    out, vision, E = {}, False, args.moe.n_experts
    for name, t in hf.items():
        if name.startswith(("vision_model.", "multi_modal_projector.", "model.vision_model.",
                            "model.multi_modal_projector.")):
            vision = True
            continue
        name = re.sub(r"^(?:model\.)?language_model\.", "", name)  # Llama4ForConditionalGeneration's text model
        name = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(name, name)
        m = re.match(r"^(?:model\.)?layers\.(\d+)\.(.+)\.(weight|gate_up_proj|down_proj)$", name)
        if name in _HF_GLOBAL:
            out[_HF_GLOBAL[name]] = t
        elif m and m.group(2) == "feed_forward.experts" and m.group(3) == "gate_up_proj":  # (E, D, 2F)
            gate, up = t.chunk(2, dim=-1)
            for e in range(E):
                out[f"layers.{m.group(1)}.feed_forward.experts.{e}.w1.weight"] = gate[e].t()
                out[f"layers.{m.group(1)}.feed_forward.experts.{e}.w3.weight"] = up[e].t()
        elif m and m.group(2) == "feed_forward.experts" and m.group(3) == "down_proj":  # (E, F, D)
            for e in range(E):
                out[f"layers.{m.group(1)}.feed_forward.experts.{e}.w2.weight"] = t[e].t()
        elif m and m.group(3) == "weight" and m.group(2) in _HF_LAYER:
            out[f"layers.{m.group(1)}.{_HF_LAYER[m.group(2)]}.weight"] = t
        else:
            raise ValueError(f"unexpected tensor {name!r} in the Hugging Face checkpoint: not a parameter of Llama 4's "
                             "text model")
    if vision:
        warnings.warn(f"{source}: vision weights skipped: {VISION}", stacklevel=3)
    out = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in out.items()}
    if "tok_embeddings.weight" in out and (tied or "output.weight" not in out):
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
