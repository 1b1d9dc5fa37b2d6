"""Meta's Llama 4 reference (llama-models' llama4 Transformer, a test dependency) on the CPU, on tiny random
configurations of the Scout shape (every layer MoE, 16 experts top-1, L2 qk-norm, Scout's scaled rope) and the
Maverick shape (MoE every 2nd layer, 128 experts cut to 8, no qk-norm): chunks of 16 positions and a temperature
floor of 8 positions, so prompts cross both. Shared by tests/formats/test_llama4_checkpoint.py and tests/llama4/."""

import os

import torch

COMMON = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "multiple_of": 16,
          "ffn_dim_multiplier": 1.2, "ffn_exp": 4.0, "norm_eps": 1e-5, "rope_theta": 500000.0,
          "nope_layer_interval": 4, "attention_chunk_size": 16, "attn_temperature_tuning": True, "floor_scale": 8.0,
          "attn_scale": 0.1}
SHAPES = {
    "scout": {**COMMON, "use_scaled_rope": True, "use_qk_norm": True,
              "moe_args": {"num_experts": 16, "capacity_factor": 1.0, "auto_scale_F": True, "top_k": 1,
                           "interleave_moe_layer_step": 1}},
    "maverick": {**COMMON, "use_qk_norm": False,
                 "moe_args": {"num_experts": 8, "capacity_factor": 1.0, "auto_scale_F": True, "top_k": 1,
                              "interleave_moe_layer_step": 2}},
}
N = 12


def meta_reference(params: dict, seed: int, max_batch_size: int = 1):
    """Meta's llama4 Transformer on the CPU with seeded random weights: fairscale's model parallel of one gloo
    rank, and .cuda() a no-op while it is built (its KV caches)."""
    import torch.distributed as dist
    from fairscale.nn.model_parallel import initialize as fs_init
    from llama_models.llama4.args import ModelArgs as MetaArgs
    from llama_models.llama4.model import Transformer as MetaTransformer

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not fs_init.model_parallel_is_initialized():
        fs_init.initialize_model_parallel(1)
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        model = MetaTransformer(MetaArgs(**params, max_seq_len=128, max_batch_size=max_batch_size))
    finally:
        torch.Tensor.cuda = cuda
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 + 1.0 if p.dim() == 1 else
                    torch.randn(p.shape, generator=g) * (p.shape[-2] ** -0.5 if p.dim() == 3 else p.shape[-1] ** -0.5))
    return model.eval()


def meta_logits(model, tokens) -> torch.Tensor:
    from llama_models.llama4.datatypes import TransformerInput

    with torch.no_grad():
        return model(TransformerInput(tokens=torch.tensor([tokens]), tokens_position=0)).logits[0]


def meta_greedy(model, prompt, n=N):
    """Greedy ids of Meta's model, each step a prefill of the whole sequence from position 0: its decode steps
    (one token, no mask) would attend past the chunk, which its prefill (and transformers) never does."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(meta_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


def meta_files(state: dict, params: dict, shards: int) -> list:
    """The state dict as Meta's files lay Llama 4 out (llama_models/checkpoint.py): experts flattened
    (moe_w_in_eD_F (E*D, F) ...), router_DE, w_in_shared_FD ..., fused wqkv and feed_forward.mlp.fc1_weight, each
    cut along its model-parallel dimension into `shards`."""
    def cut(t, dim, k):
        return t.chunk(shards, dim=dim)[k].clone()

    out = [{} for _ in range(shards)]
    E = params["moe_args"]["num_experts"]
    for name, t in state.items():
        for k in range(shards):
            s = out[k]
            if name.endswith("attention.wq.weight"):
                parts = [cut(state[name.replace(".wq.", f".{w}.")], 0, k) for w in ("wq", "wk", "wv")]
                s[name.replace("wq.weight", "wqkv.weight")] = torch.cat(parts)
            elif name.endswith(("attention.wk.weight", "attention.wv.weight", "feed_forward.w3.weight")):
                continue
            elif name.endswith("feed_forward.w1.weight"):
                w3 = state[name.replace("w1", "w3")]
                s[name.replace("w1.weight", "mlp.fc1_weight")] = torch.cat([cut(t, 0, k), cut(w3, 0, k)])
            elif name.endswith("feed_forward.w2.weight"):
                s[name.replace("w2.weight", "mlp.fc2_weight")] = cut(t, 1, k)
            elif name.endswith("experts.w1") or name.endswith("experts.w3"):
                new = "moe_w_in_eD_F" if name.endswith("w1") else "moe_w_swiglu_eD_F"
                s[name[:-2] + new] = cut(t, 2, k).flatten(0, 1)
            elif name.endswith("experts.w2"):
                s[name[:-2] + "moe_w_out_eF_D"] = cut(t, 1, k).flatten(0, 1)
            elif ".shared_expert." in name:
                w = name.split(".")[-2]
                new = {"w1": "w_in_shared_FD", "w3": "w_swiglu_FD", "w2": "w_out_shared_DF"}[w]
                s[name.replace(f"shared_expert.{w}", new)] = cut(t, 1 if w == "w2" else 0, k)
            elif name.endswith("router_DE") or "norm" in name:
                s[name] = t.clone()
            else:
                s[name] = cut(t, 1 if name.endswith("wo.weight") else 0, k)
    assert E == out[0][next(n for n in out[0] if n.endswith("router_DE"))].shape[1]
    return out
