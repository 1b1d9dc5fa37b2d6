"""Where our mixture-of-experts decode step goes (moe.py --profile): module hooks time, per layer, the attention,
the router's product, the expert products, and the rest of the MoE layer (routing: softmax and top-k, grouping:
argsort, bincount, gathers and scatters, and the weighted combine); "other" is the step less those (norms, the
embedding, the output product, sampling, the engine). Hooks cost a few microseconds each: figures, not a trace."""

import time
from collections import defaultdict


def hooked(model) -> dict:
    """Time each part of every layer into the returned totals (seconds) and count the expert calls."""
    totals, starts = defaultdict(float), {}

    def clock(module, key):
        def pre(m, args):
            starts[id(m)] = time.perf_counter()

        def post(m, args, out):
            totals[key] += time.perf_counter() - starts[id(m)]
            if key == "expert products":
                totals["expert calls"] += 1
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    for layer in model.layers:
        clock(layer.attention, "attention")
        ff = layer.feed_forward
        if hasattr(ff, "experts"):
            clock(ff, "moe")
            clock(ff.gate, "router product")
            for expert in ff.experts:
                clock(expert, "expert products")
    return totals


def profile_steps(ours, totals, prompts, n) -> dict:
    """Decode n tokens after prompts; the parts' seconds a step, the prefill's step left out."""
    from llama.core.frontend.params import SamplingParams

    reqs = ours.inputs.requests(prompts, [SamplingParams(temperature=0, max_gen_len=n)] * len(prompts))
    with ours.cache.hold():
        steps = ours.core.run(reqs)
        next(steps)  # the prefill and first sample
        totals.clear()
        start = time.perf_counter()
        count = sum(1 for _ in steps)
        wall = time.perf_counter() - start
    got = {k: v / count for k, v in totals.items()}
    got["step"] = wall / count
    return got


def measure_profile(cfg: dict) -> dict:
    from harness import prompt_tokens
    from moe import build_ours

    batch, n = cfg["batch"], max(cfg["tokens"], 8)
    ours = build_ours(cfg["file"], 16 + n + 16, batch)
    totals = hooked(ours.model)
    layers = len(ours.model.layers)
    rows, distinct = [], {}
    for b in (1, batch):
        prompts = [prompt_tokens(151643, 16, seed=s) for s in range(b)]
        profile_steps(ours, totals, prompts, 4)  # warm
        got = profile_steps(ours, totals, prompts, n)
        distinct[b] = got.pop("expert calls") / layers
        moe, step = got.pop("moe"), got["step"]
        parts = {"attention": got["attention"], "router product": got["router product"],
                 "routing, grouping, combine": moe - got["router product"] - got["expert products"],
                 "expert products": got["expert products"], "other (norms, output, sampling, engine)":
                 step - got["attention"] - moe, "whole step": step}
        for part, sec in parts.items():
            rows.append({"batch": b, "part": part, "ms a step": round(sec * 1e3, 2),
                         "ms a layer": round(sec * 1e3 / layers, 3), "share": f"{100 * sec / step:.0f} %"})
    return {"rows": rows, "distinct": distinct}
