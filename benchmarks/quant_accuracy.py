"""Accuracy of the quantization schemes against fp32 on the real models in ../shared (docs/performance.md).

    python benchmarks/quant_accuracy.py                       # stories260K and SmolLM2-135M (GGUF)
    python benchmarks/quant_accuracy.py --models stories --configs bf16 int4-g32

Per model and configuration, against the same model in fp32 (eager, compile=False):
- greedy: tokens before the first divergence from fp32's own greedy continuation (free-running, per prompt);
- argmax: teacher-forced agreement of the next-token argmax on fp32's greedy sequences (prompt + continuation),
  so one early divergence does not decide every later position;
- logit error: mean and max |logit - fp32 logit| on those positions, relative to the fp32 logits' std;
- q4_0-sim: llama.cpp q4_0's weight rounding (gguf's reference quantizer) applied to the fp32 model, as the
  q4_0-class yardstick (needs in_features % 32 == 0: SmolLM2, not stories260K);
- perplexity of llama/data/demo_corpus.txt (a short story, ~900 tokens), windows of 256, stride 128.
SmolLM2's file holds Q4_1 matrices: its "fp32" is that file dequantized, and int4 at group 32 re-quantizes
weights that already lie on a 4-bit grid of 32-wide blocks (so its error there is a lower bound, not typical).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from harness import print_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama import Llama  # noqa: E402
from llama.cli.perplexity import perplexity  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
CORPUS = Path(__file__).resolve().parents[1] / "llama" / "data" / "demo_corpus.txt"
MODELS = {
    "stories": (SHARED / "models" / "stories260K", SHARED / "models" / "stories260K" / "tokenizer.model",
                SHARED / "goldens" / "stories260K_greedy.json", 128),
    "smollm2": (SHARED / "models" / "smollm2-135m-instruct", None, SHARED / "goldens" / "smollm2_greedy.json", 64),
}
CONFIGS = {
    "bf16": dict(dtype="bf16"),
    "int8": dict(quantize="int8"),
    "int8-dynamic": dict(quantize="int8-dynamic"),
    "int4-g32": dict(quantize="int4", group_size=32),
    "int4-g64": dict(quantize="int4", group_size=64),
    "int4-g128": dict(quantize="int4", group_size=128),
    "q4_0-sim": dict(dtype="fp32"),  # fp32 model whose linear weights went through llama.cpp's q4_0 and back
}


def simulate_q4_0(model) -> None:
    """Replace every linear weight by its q4_0 round trip (gguf's reference quantizer, llama.cpp's format): the
    weight error of llama.cpp q4_0, with fp32 activations (llama.cpp also rounds activations to q8_0)."""
    import gguf

    from llama.layers import linear_layers

    qt = gguf.GGMLQuantizationType.Q4_0
    with torch.no_grad():
        for layer in linear_layers(model):
            w = layer.weight.float().numpy()
            back = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qt), qt))
            layer.weight = torch.nn.Parameter(back, requires_grad=False)  # a tied embedding keeps its values


def prompts_of(goldens: Path):
    data = json.loads(goldens.read_text())
    data = data.get("prompts", data)
    return [v["prompt_tokens"] for v in data.values()]


def evaluate(name: str, configs, threads: int) -> list:
    ckpt, tok, goldens, gen = MODELS[name]
    prompts = prompts_of(goldens)
    kw = dict(max_seq_len=256, max_batch_size=2, compile=False)
    text = CORPUS.read_text()

    def build(**extra):
        return Llama.build(str(ckpt), str(tok) if tok else None, **kw, **extra)

    ref = build(dtype="fp32")
    ref.tokenizer.stop_tokens = {}
    ref_out = [ref.generate([p], max_gen_len=gen, temperature=0)[0][0] for p in prompts]
    seqs = [torch.tensor([p + a]) for p, a in zip(prompts, ref_out)]
    ref_logits = [ref.model(s, 0)[0][len(p) - 1 : -1] for s, p in zip(seqs, prompts)]
    std = float(torch.cat([lg.flatten() for lg in ref_logits]).std())
    rows = [{"model": name, "config": "fp32", "perplexity": perplexity(ref, text, 256, 128)["perplexity"]}]
    del ref
    for cfg in configs:
        llm = build(**CONFIGS[cfg])
        if cfg == "q4_0-sim":
            simulate_q4_0(llm.model)
        llm.tokenizer.stop_tokens = {}
        diverge, diffs, same = [], [], []
        for p, a, s, la in zip(prompts, ref_out, seqs, ref_logits):
            b = llm.generate([p], max_gen_len=gen, temperature=0)[0][0]
            diverge.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
            lb = llm.model(s, 0)[0][len(p) - 1 : -1]
            diffs.append((la - lb).abs().flatten())
            same.append((la.argmax(-1) == lb.argmax(-1)).float())
        d = torch.cat(diffs)
        rows.append({"model": name, "config": cfg, "greedy_agree": diverge, "of": gen,
                     "argmax_agree": float(torch.cat(same).mean()), "mean_err": float(d.mean()) / std,
                     "max_err": float(d.max()) / std, "perplexity": perplexity(llm, text, 256, 128)["perplexity"]})
        del llm
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--configs", nargs="+", default=["bf16", "int8", "int4-g32", "int4-g64", "int4-g128"],
                    choices=list(CONFIGS))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [r for m in a.models for r in evaluate(m, a.configs, a.threads)]
    head = ["model", "config", "greedy tokens = fp32 (per prompt)", "teacher-forced argmax = fp32",
            "mean / max logit error (x fp32 std)", "perplexity"]
    table = []
    for r in rows:
        if r["config"] == "fp32":
            table.append(dict(zip(head, [r["model"], "fp32", "-", "-", "-", f"{r['perplexity']:.3f}"])))
            continue
        table.append(dict(zip(head, [r["model"], r["config"], f"{', '.join(map(str, r['greedy_agree']))} of {r['of']}",
                                     f"{100 * r['argmax_agree']:.1f}%", f"{r['mean_err']:.3f} / {r['max_err']:.2f}",
                                     f"{r['perplexity']:.3f}"])))
    print_results("quant-accuracy", table, extra={"results": rows})


if __name__ == "__main__":
    main()
