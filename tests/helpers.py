"""Shared test helpers: prompts of stories260K's goldens, and processors that pin a model's output."""

ONCE = "Once upon a time"
LILY = "Lily and Ben went to the park"
REPLACEMENT = "\ufffd"
SAMPLED = dict(temperature=1.0, top_p=1.0, max_gen_len=48)


def forcing(seq, eos_id):
    """A logits processor that forces `seq`, then EOS: makes a random model's output fully determined."""
    import torch

    def proc(ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[seq[len(ids)] if len(ids) < len(seq) else eos_id] = 0.0
        return out
    return proc


def continuation(tok, context, generated):
    """Text the generated tokens add after the context: what completion and streaming must both return."""
    return tok.decode(context + generated)[len(tok.decode(context)):]


def check_stream(deltas, final):
    assert "".join(deltas) == final
    if REPLACEMENT not in final:
        assert not any(REPLACEMENT in d for d in deltas), deltas


def build_stories(max_batch_size=4, max_seq_len=256):
    """A fresh stories260K generator (for tests that need other cache sizes than conftest's `stories`)."""
    from conftest import STORIES, need
    from llama import Llama

    need(STORIES / "consolidated.00.pth")
    return Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=max_seq_len,
                       max_batch_size=max_batch_size)


def hf_permute(w, n_heads):
    """transformers' convert_llama_weights_to_hf permute(): interleaved rotary pairs -> rotate-half halves."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


HF_LAYER_NAMES = {"attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
                  "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
                  "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
                  "ffn_norm.weight": "post_attention_layernorm.weight"}


def meta_to_hf(meta, n_layers, n_heads, n_kv_heads, tied=False):
    """A Meta-layout state dict in transformers' names and q/k layout (lm_head left out when tied)."""
    hf = {"model.embed_tokens.weight": meta["tok_embeddings.weight"], "model.norm.weight": meta["norm.weight"]}
    if not tied:
        hf["lm_head.weight"] = meta["output.weight"]
    for i in range(n_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        hf[p + "self_attn.q_proj.weight"] = hf_permute(meta[m + "attention.wq.weight"], n_heads)
        hf[p + "self_attn.k_proj.weight"] = hf_permute(meta[m + "attention.wk.weight"], n_kv_heads)
        for name, hf_name in HF_LAYER_NAMES.items():
            hf[p + hf_name] = meta[m + name]
    return hf
