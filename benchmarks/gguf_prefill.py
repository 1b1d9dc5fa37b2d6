"""Prefill of one GGUF file (Q4_K_M, Q8_0, ...) by ours, running its blocks natively, and by llama.cpp, in one
process, alternating blocks: prompt tok/s and their ratio per prompt length.

    python -m benchmarks gguf-prefill FILE.gguf [--prompts 16 128 512] [--blocks 2] [--layers 4] [--workdir DIR]

--layers N times a copy of the file cut to its first N layers (written once into --workdir, default next to the
file): at 7B each layer costs the same, so a 4-layer copy gives the per-layer rate in an eighth of the time; the
embedding and output stay (the output multiplies one row per prompt). llama.cpp evaluates in batches of 512.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from harness import child_main, print_results, prompt_tokens, run_child, run_requests

HEAD = ["file", "prompt tokens", "ours tok/s, median", "llama.cpp tok/s, median", "ours / llama.cpp, median", "range"]


def truncated(src: Path, layers: int, workdir: Path) -> Path:
    """A copy of src with only its first `layers` layers (blocks kept as they are), made once."""
    import gguf
    from tqdm import tqdm

    out = workdir / f"{src.stem}-{layers}layers.gguf"
    if out.exists():
        return out
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    tmp = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    keep = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in keep:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tqdm(keep, desc=f"cutting {src.name} to {layers} layers"):
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.rename(out)
    return out


def measure(cfg: dict) -> dict:
    """In a child process: both engines on the file, each prompt length prefilled in alternating order."""
    import llama_cpp
    import torch

    from llama import Llama
    from llama.core.frontend.params import SamplingParams
    from llama.formats import gguf_quants

    ctx = max(cfg["prompts"]) + 8
    ours = Llama.build(cfg["file"], None, max_seq_len=ctx, max_batch_size=1, dtype="bfloat16", compile=False)
    peer = llama_cpp.Llama(cfg["file"], n_ctx=ctx, n_batch=512, n_threads=torch.get_num_threads(),
                           n_threads_batch=torch.get_num_threads(), verbose=False)
    vocab = ours.model.vocab_size

    seeds = iter(range(1, 1 << 30))  # a new prompt every time: no engine may reuse a cached prefix

    def prefill_ours(length):  # the first step's interval is the prefill and one sample
        prompt = prompt_tokens(vocab, length, seed=next(seeds))
        times = run_requests(ours, [prompt], SamplingParams(temperature=0, max_gen_len=1))
        return length / (times[1] - times[0])

    def prefill_peer(length):
        prompt = prompt_tokens(vocab, length, seed=next(seeds))
        peer.reset()
        start = time.perf_counter()
        peer.eval(prompt)
        return length / (time.perf_counter() - start)

    prefill_ours(8), prefill_peer(8)  # warm both
    blocks = []
    for b in range(cfg["blocks"]):
        engines = (("ours", prefill_ours), ("peer", prefill_peer))[:: 1 if b % 2 == 0 else -1]
        block = {}
        for length in cfg["prompts"]:
            block[length] = {name: fn(length) for name, fn in engines}
            print(f"block {b} {length} tokens: " + ", ".join(f"{k} {v:.2f} tok/s" for k, v in block[length].items()),
                  file=sys.stderr, flush=True)
        blocks.append(block)
    return {"blocks": blocks, "kinds": gguf_quants.summary(ours.model), "threads": torch.get_num_threads()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--prompts", nargs="+", type=int, default=[16, 128, 512])
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--layers", type=int, help="time a copy cut to this many layers")
    p.add_argument("--workdir", help="where the cut copy goes (default: next to the file)")
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if child_main(args.child, measure):
        return
    path = Path(args.file)
    if args.layers:
        path = truncated(path, args.layers, Path(args.workdir) if args.workdir else path.parent)
    cfg = {"file": str(path), "blocks": args.blocks, "prompts": args.prompts}
    res = run_child(__file__, cfg, str(path))
    if res is None:
        sys.exit(1)
    print(f"{path.name}: {res['kinds']}, {res['threads']} threads", flush=True)
    rows = []
    for length in args.prompts:
        pairs = [b[str(length)] for b in res["blocks"]]
        ratios = [q["ours"] / q["peer"] for q in pairs]
        rows.append(dict(zip(HEAD, [path.name, length, f"{statistics.median(q['ours'] for q in pairs):.2f}",
                                    f"{statistics.median(q['peer'] for q in pairs):.2f}",
                                    f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}–{max(ratios):.2f}x"])))
    print_results("gguf-prefill", rows, args.json)


if __name__ == "__main__":
    main()
