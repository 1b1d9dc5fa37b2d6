"""Mixture-of-experts FFNs (Mixtral, Qwen3-MoE): a router picks top_k experts per token, and only those experts'
weights are read for it.

Each expert is a FeedForward of its own (Mistral's checkpoint names: feed_forward.experts.E.w1/w2/w3 and the router
feed_forward.gate), so every linear method, quantization scheme, GGUF block kernel, fusing and tensor-parallel
split that takes a dense FFN takes an expert: under model parallel each rank holds a slice of every expert (tensor
parallel), and the router is on every rank whole.

A pass groups its tokens by expert (one product per expert that has tokens), and combines a token's experts in its
own rank order, not the batch's: each row of a product is computed as it is alone (our kernels are row-invariant,
llama/kernels/invariant.py), so a token's output is the same alone, batched, verified or replayed.
"""

from typing import Tuple

import torch
from torch import nn

from llama.kernels import dense
from llama.model_args import ModelArgs, MoEArgs


class Router(nn.Module):
    """The router's logits x @ weight.T over every expert: a plain float product on every rank (never quantized or
    split: it is small, and a routing decision must not change with the arithmetic of the experts)."""

    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, self.weight)


def route(logits: torch.Tensor, moe: MoEArgs) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, k) fp32, experts (N, k) int64) of router logits (N, n_experts): softmax over every expert in
    fp32, the top k (ties to the lower index, as torch.topk), renormalised to sum to one where the model does;
    Llama 4's "sigmoid": the top k logits, each through a sigmoid in fp32."""
    if moe.router == "sigmoid":
        top, experts = torch.topk(logits, moe.top_k, dim=-1)
        return torch.sigmoid(top.float()), experts
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class MoEFeedForward(nn.Module):
    """An MoE layer's FFN: the router and moe.n_experts experts, each built by `expert(dim, width=hidden_dim)` (the
    model's dense FeedForward), and Llama 4's shared expert (feed_forward.shared_expert) where the model has one:
    its output of every token is added to the routed experts' (Meta's order: shared + routed)."""

    def __init__(self, args: ModelArgs, expert):
        super().__init__()
        moe = args.moe
        self.moe = moe
        self.ggml_arith = False  # never set: llama.cpp's arithmetic is not followed for MoE (ggml_arith.follows)
        self.gate = Router(args.dim, moe.n_experts)
        self.experts = nn.ModuleList(expert(args.dim, width=moe.hidden_dim) for _ in range(moe.n_experts))
        self.shared_expert = expert(args.dim, width=moe.hidden_dim) if moe.shared_expert else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Eager even inside a compiled step (a graph break there; eager_in_compiled_steps): the grouping's sizes
        are data (which experts the tokens picked), and the routing decision is then the eager one."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = route(self.gate(flat), self.moe)
        if self.moe.scale_inputs:  # Llama 4: each expert takes its input times its weight; outputs add unweighted
            out = combine(self.expert_outputs(flat, experts, weights.to(x.dtype)), None)
        else:
            out = combine(self.expert_outputs(flat, experts), weights.to(x.dtype))
        if self.shared_expert is not None:
            out = self.shared_expert(flat) + out
        return out.view(shape)

    def expert_outputs(self, flat: torch.Tensor, experts: torch.Tensor, scales=None) -> torch.Tensor:
        """(N, k, dim): each token's output of each of its k experts, one product per expert over its tokens (the
        tokens' rows times their scales (N, k) first, where given)."""
        n, k = experts.shape
        out = flat.new_empty(n * k, flat.shape[-1])
        picks = experts.flatten()
        order = torch.argsort(picks, stable=True)  # (token, rank) pairs grouped by expert, in token order
        counts = torch.bincount(picks, minlength=len(self.experts)).tolist()
        start = 0
        for e, count in enumerate(counts):
            if count:
                pairs = order[start : start + count]
                rows = flat[pairs // k] if scales is None else flat[pairs // k] * scales.flatten()[pairs, None]
                out[pairs] = self.experts[e](rows)
                start += count
        return out.view(n, k, -1)


def combine(outputs: torch.Tensor, weights) -> torch.Tensor:
    """sum over k of weights[:, k] * outputs[:, k] (weights None: of outputs[:, k]), added in rank order:
    elementwise, so a row's sum never depends on the other rows."""
    if weights is None:
        acc = outputs[:, 0]
        for i in range(1, outputs.shape[1]):
            acc = acc + outputs[:, i]
        return acc
    acc = outputs[:, 0] * weights[:, :1]
    for i in range(1, outputs.shape[1]):
        acc = acc + outputs[:, i] * weights[:, i : i + 1]
    return acc


def eager_in_compiled_steps() -> None:
    """Mark MoEFeedForward.forward to run eagerly inside compiled steps (torch.compiler.disable), once: called by the
    compilation layer before it traces (llama/compilation/compiled_decode.py), not at import, because
    torch.compiler.disable imports Dynamo (about 2 s of every `import llama` otherwise)."""
    if not getattr(MoEFeedForward.forward, "_eager_in_graphs", False):
        eager = torch.compiler.disable(MoEFeedForward.forward)
        eager._eager_in_graphs = True
        MoEFeedForward.forward = eager
