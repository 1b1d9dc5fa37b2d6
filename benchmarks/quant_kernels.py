"""Weight-only quantized GEMV/GEMM kernels side by side on 7B-shaped layers, in one process.

    python benchmarks/quant_kernels.py                      # 4096x4096 and 11008x4096, batch 1 and 8
    python benchmarks/quant_kernels.py --shapes 512x256 --copies 2 --batch 1   # a quick check

bf16 activations. Each kernel multiplies by `--copies` distinct matrices in turn (together larger than the
last-level cache, so the weights stream from memory, as in decoding) and reports the best of `--repeat` rounds:
ms per matrix and GB/s of the weight bytes it reads. Kernels: bf16 F.linear (oneDNN), PyTorch's ("int8":
aten._weight_int8pack_mm; "int4": aten._weight_int4pack_mm_for_cpu), ours (llama/kernels/cpu.py: int4 and
int8-dynamic with int8 activation blocks, bf16 in fp32), and torchao's weight-only configs where this torchao
version runs them on CPU (a kernel that fails is reported, not fatal).
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import print_results
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama.kernels import cpu  # noqa: E402
from llama.quantization.int4 import int4_linear, quantize_codes, quantize_int4_weight  # noqa: E402
from llama.quantization.int8 import linear as int8_linear  # noqa: E402
from llama.quantization.int8 import quantize_weight  # noqa: E402


def timed(fn, xs, repeat: int) -> float:
    """Best seconds per call over repeat rounds of one call per input pair."""
    for args in xs:
        fn(*args)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for args in xs:
            fn(*args)
        best = min(best, (time.perf_counter() - start) / len(xs))
    return best


def torchao_kernels(weights, name):
    """(label, callable(x, module)) pairs for torchao's configs that run here; failures reported as strings."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup
    except Exception as e:  # not installed, or does not import with this torch
        return [(f"torchao ({name})", f"not importable: {type(e).__name__}: {e}")]
    configs = [("torchao int8 weight-only", lambda: Int8WeightOnlyConfig()),
               ("torchao int4 weight-only g32", lambda: Int4WeightOnlyConfig(group_size=32)),
               ("torchao intx int4 g32", lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                      granularity=PerGroup(32)))]
    out = []
    for label, make in configs:
        try:
            mods = []
            for w in weights:
                m = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
                m.weight = nn.Parameter(w.clone(), requires_grad=False)
                quantize_(m, make())
                mods.append(m)
            out.append((label, mods))
        except Exception as e:
            out.append((label, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "11008x4096"], help="OUTxIN")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--copies", type=int, default=6, help="distinct matrices per kernel (stream from memory)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--group-sizes", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--torchao", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="also time torchao modules under torch.compile")
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'shape':>11} {'kernel':<34} " + " ".join(f"{'b=' + str(b) + ' ms':>9} {'GB/s':>6}" for b in a.batch))
    table = []  # the same figures as the lines printed as they come, for print_results
    for shape in a.shapes:
        n, k = map(int, shape.split("x"))
        weights = [(torch.randn(n, k) * 0.02).to(torch.bfloat16) for _ in range(a.copies)]
        rows = []
        rows.append(("bf16 F.linear", [(w,) for w in weights], lambda x, w: F.linear(x, w), 2 * n * k))
        q8 = [quantize_weight(w) for w in weights]
        rows.append(("aten int8 (_weight_int8pack_mm)", q8, lambda x, q, s: int8_linear(x, q, s), n * k + 2 * n))
        ours = cpu.available()
        if ours:
            rows.append(("ours bf16", [(w,) for w in weights], cpu.float_linear, 2 * n * k))
            q8f = [(q, s.float()) for q, s in q8]
            rows.append(("ours int8-dynamic", q8f, cpu.int8_linear, n * k + 4 * n))
        for g in a.group_sizes:
            q4 = [quantize_int4_weight(w, g) for w in weights]
            rows.append((f"aten int4 g{g} (_weight_int4pack_mm)", q4,
                         lambda x, p, sz, g=g: int4_linear(x, p, sz, n), n * k // 2 + 4 * n * k // g))
            if ours:
                rows.append((f"ours int4 g{g}", [quantize_codes(w, g) for w in weights],
                             lambda x, c, sz, g=g: cpu.int4_linear(x, c, sz, g), n * k // 2 + 4 * n * k // g))
        if a.torchao:
            for label, mods in torchao_kernels(weights, shape):
                if isinstance(mods, str):
                    print(f"{shape:>11} {label:<34} {mods}")
                    table.append({"shape": shape, "kernel": label, f"b={a.batch[0]} ms": mods})
                    continue
                nbytes = None
                rows.append((label, [(m,) for m in mods], lambda x, m: m(x), nbytes))
                if a.compile:
                    cmods = [torch.compile(copy.deepcopy(m)) for m in mods]
                    rows.append((label + " compiled", [(m,) for m in cmods], lambda x, m: m(x), nbytes))
        for label, params, fn, nbytes in rows:
            cells, row = [], {"shape": shape, "kernel": label}
            for b in a.batch:
                x = torch.randn(b, k).to(torch.bfloat16)
                try:
                    with torch.inference_mode():
                        t = timed(lambda *p: fn(x, *p), params, a.repeat)
                    gbs = f"{nbytes / t / 1e9:6.1f}" if nbytes else f"{'-':>6}"
                    cells.append(f"{t * 1e3:9.3f} {gbs}")
                    row.update({f"b={b} ms": f"{t * 1e3:.3f}", f"b={b} GB/s": gbs.strip()})
                except Exception as e:
                    cells.append(f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                    row.update({f"b={b} ms": cells[-1], f"b={b} GB/s": ""})
            print(f"{shape:>11} {label:<34} " + " ".join(cells), flush=True)
            table.append(row)
        del rows, weights
    print_results("quant-kernels", table)


if __name__ == "__main__":
    main()
