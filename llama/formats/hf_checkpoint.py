"""Hugging Face model directories (config.json + safetensors, sharded with an index, or pytorch_model*.bin) of the
LLaMA-style families: Llama, Mistral, Qwen2/2.5, Phi-3, Granite, Qwen3 (qk-norm), and the mixture-of-experts
Qwen3-MoE and Mixtral, read into ModelArgs and Meta-named weights.

What each family changes is read from its config into ModelArgs fields (llama/model.py); nothing in the decode path
knows a family. Hugging Face stores q/k rows in rotate-half (NeoX) order; the model rotates interleaved pairs
(Meta's order), so q/k rows (and Qwen2's q/k biases) are permuted at load, as Meta's and llama.cpp's converters do.
Phi-3's fused qkv_proj and gate_up_proj are split into Meta's q/k/v and w1/w3 (the loader fuses them again), and
so are the experts of transformers 5's fused layout (experts.gate_up_proj (E, 2I, D), experts.down_proj (E, D, I))
into one FFN per expert, Mistral's names (feed_forward.experts.E.w1/w2/w3, the router feed_forward.gate).
"""

import json
import re
from pathlib import Path
from typing import Dict, Optional

import torch

from llama import rope
from llama.formats import llama4
from llama.formats.meta_checkpoint import load_shard, read_json_object
from llama.model import ModelArgs, derive_ffn

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Phi3ForCausalLM": "phi3", "GraniteForCausalLM": "granite", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral", "Llama4ForCausalLM": "llama4",
                 "Llama4ForConditionalGeneration": "llama4"}  # Llama 4: llama/formats/llama4.py
QK_NORM = ("qwen3", "qwen3_moe")


def find_hf(path) -> Optional[Path]:
    """The directory, when `path` is a Hugging Face model directory (config.json and weights, no params.json)."""
    path = Path(path)
    if not path.is_dir() or (path / "params.json").exists() or not (path / "config.json").is_file():
        return None
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    return path if has_weights else None


def tokenizer_file(hf_dir) -> Path:
    """The directory's tokenizer: tokenizer.json (Hugging Face tokenizers), else a sentencepiece tokenizer.model."""
    for name in ("tokenizer.json", "tokenizer.model", "original/tokenizer.model"):
        if (Path(hf_dir) / name).is_file():
            return Path(hf_dir) / name
    raise FileNotFoundError(f"{hf_dir} has no tokenizer.json or tokenizer.model: pass tokenizer_path")


def read_config(hf_dir) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
    return read_json_object(path)


def family(config: dict, source) -> str:
    """The family of a config.json: its architectures entry, else its model_type; others refused by name."""
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = config.get("model_type", "llama")
    if not names and model_type in ARCHITECTURES.values():
        return model_type
    raise ValueError(f"{source}: architecture {names or model_type!r} is not supported (supported: "
                     f"{', '.join(ARCHITECTURES)})")


def hf_params(config: dict, source) -> dict:
    """ModelArgs keyword arguments from a config.json; refuses what these architectures do not compute."""
    fam = family(config, source)
    if fam == "llama4":
        return llama4.hf_params(config, source)
    try:
        dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        hidden, layers, vocab = int(config["intermediate_size"]), int(config["num_hidden_layers"]), int(config["vocab_size"])
    except KeyError as e:
        raise ValueError(f"{source} lacks {e.args[0]!r}") from None
    act = config.get("hidden_act", config.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not silu")
    if config.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias is not supported (no family here has biases in its MLP)")
    if fam != "qwen2" and config.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias (a bias on o_proj too) is not supported")
    if fam.startswith("qwen") and config.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window (Qwen's per-layer windows) is not supported")
    head_dim = config.get("head_dim") or dim // n_heads
    params = {"dim": dim, "n_layers": layers, "n_heads": n_heads, "vocab_size": vocab,
              "n_kv_heads": int(config.get("num_key_value_heads") or n_heads), "head_dim": int(head_dim),
              "hidden_dim": hidden, "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
              "qkv_bias": fam == "qwen2", "qk_norm": fam in QK_NORM}
    try:
        params["multiple_of"], mult = derive_ffn(dim, hidden)  # params.json's own rule, where one reproduces it
        if mult is not None:
            params["ffn_dim_multiplier"] = mult
    except ValueError:
        pass
    if fam in ("mixtral", "qwen3_moe"):
        params["moe"] = hf_moe(config, fam, source)
    if fam in ("mistral", "phi3", "mixtral") and config.get("sliding_window"):
        params["sliding_window"] = int(config["sliding_window"])
    if fam == "granite":
        params.update(embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
                      residual_multiplier=float(config.get("residual_multiplier", 1.0)),
                      attention_multiplier=float(config.get("attention_multiplier", head_dim ** -0.5)),
                      logits_scaling=float(config.get("logits_scaling", 1.0)))
    params.update(hf_rope(config, source, int(head_dim)))
    return params


def hf_moe(config: dict, fam: str, source) -> dict:
    """ModelArgs.moe from Mixtral's or Qwen3-MoE's config.json."""
    try:
        if fam == "mixtral":
            return {"n_experts": int(config["num_local_experts"]), "top_k": int(config["num_experts_per_tok"]),
                    "hidden_dim": int(config["intermediate_size"])}
        experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 5 writes the latter
        if experts is None:
            raise KeyError("num_experts")
        return {"n_experts": int(experts), "top_k": int(config["num_experts_per_tok"]),
                "hidden_dim": int(config["moe_intermediate_size"]),
                "renormalize": bool(config.get("norm_topk_prob", False)),
                "every": int(config.get("decoder_sparse_step") or 1),
                "dense_layers": [int(i) for i in config.get("mlp_only_layers") or []]}
    except KeyError as e:
        raise ValueError(f"{source} lacks {e.args[0]!r}") from None


def hf_args(config: dict, source, **overrides) -> ModelArgs:
    return ModelArgs(**{**hf_params(config, source), **overrides})


def hf_rope(config: dict, source, head_dim: Optional[int] = None) -> dict:
    """ModelArgs' rotary fields from config.json's `rope_scaling` (older transformers) or `rope_parameters` (newer,
    which also holds rope_theta): Llama 3.1's scaling, linear, YaRN and long-rope (Phi-3's "su" too)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or params
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    out = {"rope_theta": float(params.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if float(scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor (rotary on part of each head) is not supported")
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    original = scaling.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    try:
        if kind == "default":
            return out
        if kind == "llama3":
            return {**out, "use_scaled_rope": True, "rope_scaling_factor": float(scaling["factor"]),
                    "rope_low_freq_factor": float(scaling["low_freq_factor"]),
                    "rope_high_freq_factor": float(scaling["high_freq_factor"]),
                    "rope_original_context": int(scaling["original_max_position_embeddings"])}
        if kind == "linear":
            return {**out, "rope_scaling": {"rope_type": "linear", "factor": float(scaling["factor"])}}
        if kind == "yarn":
            original = int(original if original is not None else config["max_position_embeddings"])
            factor = scaling.get("factor") or config["max_position_embeddings"] / original
            attention = scaling.get("attention_factor") or rope.yarn_attention_factor(
                factor, scaling.get("mscale"), scaling.get("mscale_all_dim"))
            return {**out, "rope_scaling": {
                "rope_type": "yarn", "factor": float(factor), "original_context": original,
                "beta_fast": float(scaling.get("beta_fast") or 32), "beta_slow": float(scaling.get("beta_slow") or 1),
                "truncate": bool(scaling.get("truncate", True)), "attention_factor": float(attention)}}
        if kind in ("longrope", "su"):
            original = int(original)
            factor = scaling.get("factor") or config["max_position_embeddings"] / original
            attention = scaling.get("attention_factor") or rope.longrope_attention_factor(factor, original)
            return {**out, "rope_scaling": {
                "rope_type": "longrope", "short_factor": [float(v) for v in scaling["short_factor"]],
                "long_factor": [float(v) for v in scaling["long_factor"]], "original_context": original,
                "attention_factor": float(attention)}}
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source}: {key} of type {kind!r} lacks {e.args[0]!r}") from None
    raise ValueError(f"{source}: {key} of type {kind!r} is not supported (supported: default, llama3, linear, yarn, "
                     "longrope)")


def read_safetensors(path) -> Dict[str, torch.Tensor]:
    """Tensors of a .safetensors file, memory-mapped by the safetensors package (as Hugging Face reads them)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None


def read_hf_weights(hf_dir) -> Dict[str, torch.Tensor]:
    """All tensors of a HF model directory: (sharded) safetensors, else (sharded) pytorch_model*.bin."""
    hf_dir = Path(hf_dir)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = hf_dir / index_name
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError) as e:
                raise ValueError(f"{index} is not a valid index (a JSON object with weight_map): {e}") from None
            break
    else:
        files = [p.name for p in sorted(hf_dir.glob("*.safetensors"))] or \
                [p.name for p in sorted(hf_dir.glob("pytorch_model*.bin"))]
        if not files:
            raise FileNotFoundError(f"no model.safetensors or pytorch_model*.bin in {hf_dir}")
    state = {}
    for name in files:
        path = hf_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in the index but missing")
        state.update(read_safetensors(path) if name.endswith(".safetensors") else load_shard(path))
    return state


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of q or k (a weight, or a bias) from rotate-half order within each head to Meta's interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """unpermute's inverse: Meta's interleaved pairs back to rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_LAYER = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
    "mlp.gate": "feed_forward.gate", "block_sparse_moe.gate": "feed_forward.gate",
}
# an expert's projections: Qwen3-MoE's (mlp.experts.E.gate_proj ...) and Mixtral's (block_sparse_moe.experts.E.w1 ...)
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")
_EXPERT_W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3", "w1": "w1", "w2": "w2", "w3": "w3"}
_GLOBAL = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}


def split_fused(name: str, t: torch.Tensor, args: ModelArgs) -> Dict[str, torch.Tensor]:
    """Phi-3's fused tensors as their parts: qkv_proj -> q/k/v projections, gate_up_proj -> gate and up."""
    if name.endswith("self_attn.qkv_proj.weight"):
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        parts = zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv]))
        return {name.replace("qkv_proj", p): w for p, w in parts}
    if name.endswith("mlp.gate_up_proj.weight"):
        gate, up = t.chunk(2)
        return {name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up}
    if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5's fused experts: (E, 2 * hidden, dim)
        base = name[: -len("gate_up_proj")]
        out = {}
        for e, w in enumerate(t.unbind(0)):
            gate, up = w.chunk(2)
            out.update({f"{base}{e}.gate_proj.weight": gate, f"{base}{e}.up_proj.weight": up})
        return out
    if name.endswith("mlp.experts.down_proj"):  # (E, dim, hidden)
        base = name[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": w for e, w in enumerate(t.unbind(0))}
    return {name: t}


def meta_layer_name(parts) -> Optional[str]:
    """Meta's name of a HF layer tensor model.layers.N.<local>.<kind>, None where this architecture has none."""
    local, kind = ".".join(parts[3:-1]), parts[-1]
    if parts[:2] != ["model", "layers"] or len(parts) <= 4 or kind not in ("weight", "bias"):
        return None
    if local in _LAYER:
        return f"layers.{parts[2]}.{_LAYER[local]}.{kind}"
    expert = _EXPERT.match(local)
    if expert and kind == "weight":
        return f"layers.{parts[2]}.feed_forward.experts.{expert.group(1)}.{_EXPERT_W[expert.group(2)]}.weight"
    return None


def hf_to_meta(hf: Dict[str, torch.Tensor], args: ModelArgs, dtype: Optional[torch.dtype] = None,
               tied: bool = False) -> Dict[str, torch.Tensor]:
    """Rename HF tensors to Meta's names, split Phi-3's fused ones and permute q/k rows into Meta's rotary order;
    a missing lm_head (or tie_word_embeddings) means tied embeddings."""
    if llama4.is_llama4(args):
        return llama4.hf_to_meta(hf, args, dtype, tied)
    out = {}
    for full_name, full in hf.items():
        if full_name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older HF checkpoints save; recomputed from the config
        for name, t in split_fused(full_name, full, args).items():
            kind = name.rpartition(".")[2]
            meta = _GLOBAL[name] if name in _GLOBAL else meta_layer_name(name.split("."))
            if meta is None or (kind == "bias" and not args.qkv_bias):
                raise ValueError(f"unexpected tensor {full_name!r} in the Hugging Face checkpoint: not a parameter "
                                 "of this architecture")
            if ".wq." in meta:
                t = unpermute(t, args.n_heads)
            elif ".wk." in meta:
                t = unpermute(t, args.n_kv_heads)
            elif meta.endswith("_norm.weight") and ".attention." in meta:  # qk-norm: within a head, as its rows
                t = unpermute(t, 1)
            out[meta] = t.to(dtype) if dtype is not None else t
    if "tok_embeddings.weight" in out and (tied or "output.weight" not in out):
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def load(hf_dir, dtype: Optional[torch.dtype] = None, **overrides):
    """(ModelArgs keyword arguments, full Meta-named state dict) of a Hugging Face directory."""
    hf_dir = Path(hf_dir)
    config = read_config(hf_dir)
    params = hf_params(config, hf_dir / "config.json")
    args = ModelArgs(**{**params, **overrides, "vocab_size": params["vocab_size"]})
    return params, hf_to_meta(read_hf_weights(hf_dir), args, dtype, bool(config.get("tie_word_embeddings")))
