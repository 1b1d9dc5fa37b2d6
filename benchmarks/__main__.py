"""python -m benchmarks MEASUREMENT [its arguments]: one entry point for every measurement in docs/performance.md.

Each measurement is a module of this directory with its own arguments (`python -m benchmarks NAME --help`); what
they share (paths, shapes, --workdir weights, peers, alternating rounds, the results table) is harness.py.
Measurements spawn fresh worker processes of their own module, so each figure comes from a clean process.
A measurement prints its results as markdown tables, each followed by the same rows as one `JSON {...}` line;
`--json PATH`, taken here for all of them, also writes those lines to PATH (one a table). A few older probes
(speculative*, gguf-agreement, -arith, -cpu-time, -load, -perplexity) print their own lines: --json says it wrote none.
"""

import argparse
import importlib
import inspect
import sys
from pathlib import Path

# name -> (module, what it measures). Names say what is measured; docs/performance.md quotes these commands.
MEASUREMENTS = {
    "decode-prefill": ("bench", "prefill and decode tokens/s by model, dtype/scheme, compile and batch, beside "
                                "transformers and llama.cpp on the same weights (--compare hf llamacpp)"),
    "int8-agreement": ("bench", "int8 and int8-dynamic against fp32 on the stories260K goldens (decode-prefill "
                                "--accuracy)"),
    "paired-llamacpp": ("paired", "batch-1 decode or prefill against llama.cpp in one process, alternating blocks: "
                                  "ratios the machine's drift cancels"),
    "first-token": ("first_token", "time to the first token from a fresh process, weights preloaded or mapped"),
    "compile-gguf": ("compile_gguf", "decode of one GGUF file eager against compile=True, fresh processes "
                                     "alternating: whether compile=\"auto\" should compile GGUF-block models"),
    "first-run": ("first_run", "a newcomer's first `python example_chat_completion.py` from a fresh $LLAMA_CACHE: "
                               "model fetch, kernels, compile=\"auto\" and three answers, timed end to end"),
    "compile-auto": ("bench_compile_auto", "total time of a generation, compile included, for compile=False, "
                                           "True and \"auto\""),
    "serve-load": ("bench_serve", "the HTTP server under N concurrent streaming clients (TTFT p50/p99, tokens/s), "
                                  "optionally beside llama-cpp-python's server"),
    "cache-reuse": ("bench_serving", "what reusing a KV cache saves: n samples of one prompt, a shared prefix, a "
                                     "chat session"),
    "prefix-cache": ("prefix_cache", "the paged KV pool: sequences per GiB at 7B shapes, prefix caching's "
                                     "divergence rate, N users sharing a system prompt (TTFT on against off)"),
    "batching": ("bench_batching", "continuous batching (the engine) against static batching"),
    "speculative": ("speculative", "speculative decoding: a verify pass's cost c(k), and what prompt lookup, a "
                                   "prediction or a draft model gains on SmolLM2 (--llama-cpp: its lookup beside)"),
    "speculative-compiled": ("speculative_compiled", "speculation with a compiled decode step: c(k) eager against "
                                                     "compiled, and greedy tokens that differ with speculation on"),
    "speculative-products": ("speculative_products", "each GGUF weight product's time per row count (a verify's "
                                                     "rows) on a real file, optionally against another checkout"),
    "parallel-layouts": ("bench_pipeline", "tensor parallel against tensor x pipeline parallel: step time, bytes "
                                           "between ranks"),
    "gpu": ("bench_gpu", "decode and prefill on a CUDA GPU beside transformers and gpt-fast, and its bandwidth"),
    "grammar-libraries": ("bench_grammar", "structured-output mask cost: llguidance, xgrammar and outlines-core"),
    "quality": ("quality", "KL divergence, top-1 agreement and greedy answers of each GGUF arithmetic (ours fp32 and "
                           "int8 activations, llama.cpp) against the same file dequantized to fp32"),
    "quant-accuracy": ("quant_accuracy", "accuracy of each quantization scheme against fp32 on the shared models"),
    "quant-kernels": ("quant_kernels", "weight-only quantized GEMV/GEMM kernels side by side on 7B-shaped layers"),
    "load-memory": ("load_memory", "peak RSS of one rank loading a checkpoint, sharded and not"),
    "gguf-blocks": ("gguf_blocks", "batch-1 decode of one GGUF file (Q4_K_M, Q8_0, ...) run in its own blocks beside "
                                   "llama.cpp on the same file, alternating blocks"),
    "gguf-prefill": ("gguf_prefill", "prefill of 16/128/512 tokens of one GGUF file run in its own blocks beside "
                                     "llama.cpp on the same file, alternating blocks (--layers N: a cut copy)"),
    "gguf-kernels": ("gguf_kernels", "GGUF block products per format on 7B-shaped layers, AVX2 against AVX-512 VNNI, "
                                     "alternating rounds"),
    "gguf-load": ("gguf_load", "cold load of GGUF files to the first token and peak RSS, ours against llama.cpp, "
                               "a fresh process per case"),
    "gguf-load-memory": ("gguf_load_memory", "peak RSS of loading a Q8_0 GGUF to bf16 and to int8"),
    "gguf-agreement": ("gguf_agreement", "where our greedy ids and llama.cpp's part on the same GGUF file "
                                         "(--make: llama.cpp's own requantizations of the shared file too)"),
    "gguf-perplexity": ("gguf_perplexity", "perplexity of one GGUF file by ours and by llama.cpp on the same token "
                                           "ids and windows"),
    "gguf-arith": ("gguf_arith", "batch-1 decode of a GGUF file with llama.cpp's arithmetic between the products "
                                 "(LLAMA_GGML_ARITH=1) against our own, fresh processes alternating"),
    "gguf-cpu-time": ("gguf_cpu_time", "process CPU time of one-row GGUF block products per format, one thread: "
                                       "checkouts compared on a busy machine (run from each)"),
    "moe": ("moe", "mixture-of-experts at Qwen3-30B-A3B's shape (a random GGUF qwen3moe, Q4_K_M and bf16, cut to "
                   "N layers): decode at batch 1 and 8, prefill, load and peak RSS beside llama.cpp on the same file, "
                   "bytes a token reads against the read roofline, and where our step goes (--profile)"),
    "tied-memory": ("tied_memory", "peak RSS with tied against untied embeddings (Llama 3.2's vocabulary)"),
}
PROG = "python -m benchmarks"
# The measurements import the harness as `harness` (this directory on sys.path) or as `benchmarks.harness`: two
# module objects, so --json is set on both. Some (the gguf-* and speculative* scripts) print their own results.
HARNESSES = ("harness", "benchmarks.harness")
JSON_HELP = ("common option, taken by python -m benchmarks for every measurement:\n"
             "  --json PATH           also write each results table's JSON line to PATH (one line a table)")


def parser() -> argparse.ArgumentParser:
    width = max(map(len, MEASUREMENTS))
    listing = "\n".join(f"  {name:{width}}  {what}" for name, (_, what) in MEASUREMENTS.items())
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"measurements:\n{listing}\n\n{JSON_HELP}\n\n`{PROG} NAME --help` gives one's arguments.")
    p.add_argument("measurement", choices=list(MEASUREMENTS), metavar="MEASUREMENT", help="one of those below")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the measurement's own arguments")
    p.add_argument("--json", metavar="PATH", help="as below (also accepted after MEASUREMENT)")
    return p


def take_json(argv: list) -> tuple:
    """(argv without `--json PATH` / `--json=PATH`, PATH or None): the option every measurement shares."""
    rest, path, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--json":
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise SystemExit(f"{PROG}: --json needs a PATH to write the results to")
            path, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--json="):
            path = argv[i][len("--json="):]
        else:
            rest.append(argv[i])
        i += 1
    return rest, path


def run(name: str, argv: list) -> int:
    """Import the measurement's module (as its script would run: this directory first on sys.path) and call its
    main with argv, through sys.argv for the modules whose main() reads it; `--json PATH` goes to the harness."""
    module, _ = MEASUREMENTS[name]
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    argv, json_path = take_json(argv)
    harnesses = [importlib.import_module(h) for h in HARNESSES]
    for harness in harnesses:
        harness.JSON_PATH = json_path
    if name == "int8-agreement":
        argv = ["--accuracy", *argv]
    main = importlib.import_module(module).main
    sys.argv = [f"{PROG} {name}", *argv]
    try:
        result = main(argv) if inspect.signature(main).parameters else main()
    except SystemExit as e:
        if e.code in (0, None) and {"-h", "--help"} & set(argv):
            print(f"\n{JSON_HELP}")
        raise
    if json_path and not any(json_path in harness._written for harness in harnesses):
        print(f"{PROG} {name}: no results table went through harness.py, so nothing was written to {json_path}",
              file=sys.stderr)
    return result if isinstance(result, int) else 0  # bench_batching's main returns its results


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    return run(a.measurement, a.args + (["--json", a.json] if a.json else []))


if __name__ == "__main__":
    sys.exit(main())
