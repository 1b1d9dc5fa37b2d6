"""Decode and prefill speed on a CUDA GPU, beside transformers and gpt-fast on the same weights, and the GPU's
measured memory bandwidth (the roofline of batch-1 decoding), all in one run.

    python benchmarks/bench_gpu.py --model 7b 8b --dtypes bf16 int8 --batch 1 8 32 \
        --compare hf gpt-fast --gpt-fast /path/to/a/copy/of/gpt-fast

Weights are random (std 0.02), made on the GPU from a fixed seed by every worker process alike, so the engines run
the same weights without a checkpoint on disk. Shapes: 7b = Llama 2 7B (32000 vocabulary), 8b = Llama 3 8B
(128256 vocabulary, 8 KV heads). Each (engine, shape, dtype) runs in a fresh process, so peak GPU memory and
compile state are its own. gpt-fast is imported from its own checkout (pytorch-labs/gpt-fast; never vendored):
its model, its generate() and its compile settings (decode_one_token under mode="reduce-overhead").

Timing, the same for every engine: a run generates N tokens for B copies of a P-token prompt, greedy, with a
device synchronisation at the end; TTFT is the median time of a run that generates 1 token, and decode tok/s =
B * (N - 1) / (median run time - TTFT), i.e. aggregate tokens per second after the first.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from harness import print_results

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "7b": dict(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256, norm_eps=1e-5),
    "smoke": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32000, multiple_of=32, norm_eps=1e-5),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
               ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0),
}


def model_args(shape: str, max_seq_len: int, max_batch: int):
    from llama.model import ModelArgs

    return ModelArgs.from_params(SHAPES[shape], max_seq_len=max_seq_len, max_batch_size=max_batch)


def random_state(args, device, seed: int = 0) -> dict:
    """Meta-layout bf16 weights made on the device from `seed` (the same in every process)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hd, hidden = args.head_dim, args.hidden_dim

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, device=device, dtype=torch.bfloat16)  # noqa: E731
    state = {"tok_embeddings.weight": w(args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        state.update({p + "attention.wq.weight": w(args.n_heads * hd, args.dim),
                      p + "attention.wk.weight": w(args.n_kv_heads * hd, args.dim),
                      p + "attention.wv.weight": w(args.n_kv_heads * hd, args.dim),
                      p + "attention.wo.weight": w(args.dim, args.n_heads * hd),
                      p + "feed_forward.w1.weight": w(hidden, args.dim),
                      p + "feed_forward.w2.weight": w(args.dim, hidden),
                      p + "feed_forward.w3.weight": w(hidden, args.dim),
                      p + "attention_norm.weight": ones(args.dim), p + "ffn_norm.weight": ones(args.dim)})
    state.update({"norm.weight": ones(args.dim), "output.weight": w(args.vocab_size, args.dim)})
    return state


def prompt_ids(vocab: int, length: int):
    g = torch.Generator().manual_seed(0)
    return [1] + torch.randint(3, min(vocab, 32000), (length - 1,), generator=g).tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_time(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def measure(gen, batches, N, repeat) -> dict:
    """gen(b, n) -> the first generated ids of row 0. Per batch size: decode tok/s from the difference between runs
    of N and of 2 tokens (prefill and fixed costs cancel), and TTFT as the 2-token run less one decode step."""
    out = {"decode_tps": {}, "ttft_ms": {}, "warmup_s": {}}
    for b in batches:
        ids = []
        out["warmup_s"][b] = sync_time(lambda: ids.extend(gen(b, N)))  # compiles (ours, gpt-fast) on first use
        out.setdefault("ids", ids)
        gen(b, 2)
        short = statistics.median(sync_time(lambda: gen(b, 2)) for _ in range(repeat))
        full = statistics.median(sync_time(lambda: gen(b, N)) for _ in range(repeat))
        step = max(full - short, 1e-9) / (N - 2)
        out["decode_tps"][b] = b / step
        out["ttft_ms"][b] = (short - step) * 1e3
    return out


def profile(fn) -> str:
    """Where the host's time goes in one run (cProfile, by own time): what keeps the GPU waiting between steps."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    sync()
    prof.enable()
    fn()
    sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()[-6000:]


def weight_gb(model) -> float:
    """GB one decode step reads: every parameter but the embedding table."""
    named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()  # gpt-fast's int8/int4
                                              if n.endswith(("weight", "scales", "scales_and_zeros"))]
    return sum(p.numel() * p.element_size() for n, p in named if "embed" not in n) / 1e9


# --------------------------------------------------------------------------------------------- engines
def run_llama(cfg: dict) -> dict:
    from llama import Llama
    from llama.compilation.compiled_decode import compile_decode
    from llama.config import memory_config
    from llama.distributed import parallel
    from llama.model import Transformer
    from llama.quantization.schemes import cast_floating, quantize
    from llama.tokenizers.sentencepiece import load_tokenizer

    P, N, B = cfg["prompt"], cfg["gen"], max(cfg["batch"])
    device = torch.device(cfg["device"])
    parallel.init_distributed(1, device)
    args = model_args(cfg["shape"], P + N, B)
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(random_state(args, device), assign=True)
    model.eval().fuse()
    if cfg["dtype"] in ("int8", "int4"):
        quantize(model, cfg["dtype"], cfg["int4_group"] if cfg["dtype"] == "int4" else None)  # int4: tinygemm
    cast_floating(model, torch.bfloat16)
    tokenizer = load_tokenizer(cfg["tokenizer"])
    tokenizer.stop_tokens = {}  # random weights: every run decodes N tokens
    prompt = prompt_ids(args.vocab_size, P)
    x = torch.tensor([prompt], device=device)
    out = {}
    for b in cfg["batch"]:  # a generator (KV cache, compiled graph) sized for each batch, as a user would build it
        llm = Llama(model, tokenizer, compiled=compile_decode(model, cfg["compile"]),
                    config=memory_config(model, b, P + N, compile=cfg["compile"]))
        if "prefill_tps" not in out:
            llm.model(x, 0)
            out["prefill_tps"] = P / min(sync_time(lambda: llm.model(x, 0)) for _ in range(cfg["repeat"]))

        def gen(b, n):
            tokens, _ = llm.generate([prompt] * b, max_gen_len=n, temperature=0)
            return tokens[0][:16]

        for k, v in measure(gen, [b], N, cfg["repeat"]).items():
            out[k] = {**out[k], **v} if isinstance(v, dict) and k in out else out.get(k, v)
        if cfg.get("profile") and b == cfg["batch"][0]:
            out["profile"] = profile(lambda: gen(b, N))
        del llm
    out["weight_gb"] = weight_gb(model)
    return out


def run_hf(cfg: dict) -> dict:
    """transformers' LlamaForCausalLM.generate (greedy, its default dynamic cache, eager), same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    P, N = cfg["prompt"], cfg["gen"]
    args = model_args(cfg["shape"], P + N, max(cfg["batch"]))
    meta = random_state(args, torch.device(cfg["device"]))
    conf = LlamaConfig(hidden_size=args.dim, intermediate_size=args.hidden_dim, num_hidden_layers=args.n_layers,
                       num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                       vocab_size=args.vocab_size, rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
                       max_position_embeddings=P + N, tie_word_embeddings=False)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(cfg["device"]):
        model = LlamaForCausalLM(conf)  # its own random init, then overwritten: simplest way to a complete model
    torch.set_default_dtype(torch.float32)

    def permute(w, heads):  # Meta's interleaved rotary pairs -> transformers' halves
        rows, cols = w.shape
        return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    hf = {"model.embed_tokens.weight": meta.pop("tok_embeddings.weight"), "model.norm.weight": meta.pop("norm.weight"),
          "lm_head.weight": meta.pop("output.weight")}
    for i in range(args.n_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        hf[p + "self_attn.q_proj.weight"] = permute(meta.pop(m + "attention.wq.weight"), args.n_heads)
        hf[p + "self_attn.k_proj.weight"] = permute(meta.pop(m + "attention.wk.weight"), args.n_kv_heads)
        for a, b in (("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
                     ("mlp.gate_proj", "feed_forward.w1"), ("mlp.up_proj", "feed_forward.w3"),
                     ("mlp.down_proj", "feed_forward.w2"), ("input_layernorm", "attention_norm"),
                     ("post_attention_layernorm", "ffn_norm")):
            hf[p + a + ".weight"] = meta.pop(m + b + ".weight")
    missing, unexpected = model.load_state_dict(hf, strict=False)
    if unexpected or any("rotary" not in k for k in missing):
        raise RuntimeError(f"weight names do not match transformers': {missing} {unexpected}")
    del hf
    model.eval()
    prompt = torch.tensor([prompt_ids(args.vocab_size, P)], device=cfg["device"])
    with torch.inference_mode():
        model(prompt)
        out = {"prefill_tps": P / min(sync_time(lambda: model(prompt)) for _ in range(cfg["repeat"]))}

        def gen(b, n):
            ids = prompt.expand(b, -1)
            y = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            return y[0, P:P + 16].tolist()

        out.update(measure(gen, cfg["batch"], N, cfg["repeat"]))
    out["weight_gb"] = weight_gb(model)
    return out


def gpt_fast_int4(model, group_size: int):
    """gpt-fast's own int4 handler (tinygemm, inner k-tiles 8). Its packer call predates PyTorch 2.5, which takes
    the codes two per uint8 (even input in the high nibble) instead of int32: its helper is wrapped to pass that."""
    import quantize as gq

    pack = torch.ops.aten._convert_weight_to_int4pack

    def prepare(weight_bf16, groupsize, inner_k_tiles):
        w, scales_and_zeros = gq.group_quantize_tensor(weight_bf16, n_bit=4, groupsize=groupsize)
        if w.dtype != torch.uint8:
            w = (w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8)
        return pack(w, inner_k_tiles), scales_and_zeros

    gq.prepare_int4_weight_and_scales_and_zeros = prepare
    handler = gq.WeightOnlyInt4QuantHandler(model.to(torch.bfloat16), groupsize=group_size)
    state = handler.create_quantized_state_dict()
    model = handler.convert_for_runtime()
    model.load_state_dict(state, assign=True)
    return model


def run_gpt_fast(cfg: dict) -> dict:
    """gpt-fast's Transformer and generate() with its own compile settings, same weights (wq/wk/wv -> wqkv)."""
    sys.path.insert(0, cfg["gpt_fast"])
    import generate as gf  # gpt-fast's generate.py (sets its Inductor options on import)
    from model import ModelArgs, Transformer

    P, N = cfg["prompt"], cfg["gen"]
    args = model_args(cfg["shape"], P + N, max(cfg["batch"]))
    meta = random_state(args, torch.device(cfg["device"]))
    conf = ModelArgs(block_size=P + N, vocab_size=args.vocab_size, n_layer=args.n_layers, n_head=args.n_heads,
                     dim=args.dim, intermediate_size=args.hidden_dim, n_local_heads=args.n_kv_heads,
                     rope_base=args.rope_theta, norm_eps=args.norm_eps)
    with torch.device("meta"):
        model = Transformer(conf)
    for i in range(args.n_layers):
        p = f"layers.{i}.attention."
        meta[p + "wqkv.weight"] = torch.cat([meta.pop(p + k + ".weight") for k in ("wq", "wk", "wv")])
    model.load_state_dict(meta, assign=True)
    del meta
    if cfg["dtype"] == "int8":
        from quantize import WeightOnlyInt8QuantHandler

        handler = WeightOnlyInt8QuantHandler(model)
        state = handler.create_quantized_state_dict()
        model = handler.convert_for_runtime()
        model.load_state_dict(state, assign=True)
    if cfg["dtype"] == "int4":
        model = gpt_fast_int4(model, cfg["int4_group"])
    model = model.to(device=cfg["device"]).eval()
    gf.decode_one_token = torch.compile(gf.decode_one_token, mode="reduce-overhead", fullgraph=True)
    prompt = torch.tensor(prompt_ids(args.vocab_size, P), device=cfg["device"], dtype=torch.int)
    with torch.device(cfg["device"]):
        model.setup_caches(max_batch_size=1, max_seq_length=P + N)
    with torch.no_grad():
        model(prompt.view(1, -1).long(), torch.arange(P, device=cfg["device"]))
        out = {"prefill_tps": P / min(sync_time(lambda: model(prompt.view(1, -1).long(), torch.arange(P, device=cfg["device"])))
                                      for _ in range(cfg["repeat"]))}

    def gen(b, n):
        if model.max_batch_size != b:  # its attention returns the cache's batch: caches must match b exactly
            model.max_batch_size = -1
        y, _ = gf.generate(model, prompt, n, batch_size=b, interactive=False, draft_model=None,
                           temperature=0.0, top_k=None)  # temperature 0: argmax of its sampler, as greedy
        return y[0, P:P + 16].tolist()

    out.update(measure(gen, cfg["batch"], N, cfg["repeat"]))
    out["weight_gb"] = weight_gb(model)
    return out


def bandwidth(device: str) -> dict:
    """GB/s of a 4 GiB device-to-device copy (bytes read + written) and of a 4 GiB read (a sum)."""
    x = torch.empty(2**30 if device == "cuda" else 2**26, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    y.copy_(x), x.sum()
    copy = min(sync_time(lambda: y.copy_(x)) for _ in range(10))
    read = min(sync_time(lambda: x.sum()) for _ in range(10))
    return {"copy_gbs": 2 * x.numel() * 4 / copy / 1e9, "read_gbs": x.numel() * 4 / read / 1e9}


ENGINES = {"llama": run_llama, "hf": run_hf, "gpt-fast": run_gpt_fast}


def worker(cfg: dict) -> dict:
    os.environ["LLAMA_ASYNC_DECODE"] = cfg.get("async_decode", "auto")  # read by llama.settings on first use
    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        out = ENGINES[cfg["engine"]](cfg)
    except Exception as e:  # one failing engine must not lose the others' figures
        import traceback

        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    out["total_s"] = time.perf_counter() - start
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return out


def spawn(cfg: dict, timeout: float) -> dict:
    try:
        p = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"exit {p.returncode}: {p.stderr[-2000:]}"}


def table(rows, batches) -> list:
    """The results table's rows, one per configuration."""
    head = (["model", "engine", "weights", "load+warm s", "peak GiB", "prefill tok/s", "TTFT ms (b=1)"]
            + [f"decode b={b}" for b in batches] + ["b=1 GB/s"])
    out = []
    for cfg, r in rows:
        engine = cfg["engine"] + (f" async={cfg['async_decode']}" if cfg.get("async_decode", "auto") != "auto" else "")
        name = [cfg["shape"], engine, cfg["dtype"]]
        if "error" in r:
            out.append({**dict.fromkeys(head, ""), **dict(zip(head, name)), "load+warm s": f"failed: {r['error'][:150]}"})
            continue
        d = r["decode_tps"]
        gbs = d.get("1", d.get(1, 0)) * r["weight_gb"]
        out.append(dict(zip(head, name + [f"{r['total_s']:.0f}", f"{r['peak_gib']:.1f}", f"{r['prefill_tps']:.0f}",
                                          f"{r['ttft_ms'].get('1', r['ttft_ms'].get(1, 0)):.1f}"]
                            + [f"{d.get(str(b), d.get(b, 0)):.1f}" for b in batches] + [f"{gbs:.0f}"])))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["7b"], choices=sorted(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8", "int4"])
    ap.add_argument("--int4-group", type=int, default=32, help="int4 group size, ours and gpt-fast's alike")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compare", nargs="*", default=["hf", "gpt-fast"], choices=["hf", "gpt-fast"])
    ap.add_argument("--compare-dtypes", nargs="+", default=["bf16"], choices=["bf16", "int8", "int4"],
                    help="dtypes gpt-fast runs (transformers runs bf16 only)")
    ap.add_argument("--gpt-fast", help="a checkout of pytorch-labs/gpt-fast (needed for --compare gpt-fast)")
    ap.add_argument("--compile", default="true", choices=["true", "false", "auto"], help="our compile= setting")
    ap.add_argument("--llama2-tokenizer", default=str(REPO.parent / "shared/tokenizers/llama2/tokenizer.model"))
    ap.add_argument("--llama3-tokenizer", default=str(REPO.parent / "shared/tokenizers/llama3/tokenizer.model"))
    ap.add_argument("--compare-batch", nargs="+", type=int, help="batch sizes for gpt-fast (default: --batch)")
    ap.add_argument("--async-decode", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                    help="our LLAMA_ASYNC_DECODE (llama/core/worker/ahead.py; auto = on for one CUDA process): one run of ours "
                         "per value, e.g. 'off on' for both side by side")
    ap.add_argument("--profile", action="store_true", help="also print where our host time goes at the first batch")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a smoke test of this script
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))), flush=True)
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU (benchmarks/bench.py measures the CPU)")
    if "gpt-fast" in a.compare and not (a.gpt_fast and Path(a.gpt_fast, "generate.py").exists()):
        ap.error("--compare gpt-fast needs --gpt-fast pointing at a checkout of pytorch-labs/gpt-fast")
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    bw = bandwidth(a.device)
    print(f"{name}, torch {torch.__version__}; copy "
          f"{bw['copy_gbs']:.0f} GB/s (read+write), read {bw['read_gbs']:.0f} GB/s", flush=True)
    compile_flag = {"true": True, "false": False, "auto": "auto"}[a.compile]
    rows = []
    for shape in a.model:
        tok = a.llama3_tokenizer if SHAPES[shape]["vocab_size"] > 32000 else a.llama2_tokenizer
        base = dict(device=a.device, shape=shape, prompt=a.prompt, gen=a.gen, batch=a.batch, repeat=a.repeat, tokenizer=tok, int4_group=a.int4_group,
                    gpt_fast=str(Path(a.gpt_fast).resolve()) if a.gpt_fast else None, compile=compile_flag)
        cfgs = [dict(base, engine="llama", dtype=d, profile=a.profile, async_decode=v)
                for d in a.dtypes for v in a.async_decode]
        cfgs += [dict(base, engine="gpt-fast", dtype=d, batch=a.compare_batch or a.batch)
                 for d in a.compare_dtypes if "gpt-fast" in a.compare]
        cfgs += [dict(base, engine="hf", dtype="bf16")] if "hf" in a.compare else []
        for cfg in cfgs:
            r = spawn(cfg, a.timeout)
            rows.append((cfg, r))
            print(r.pop("profile", ""), flush=True)
            print(json.dumps({"cfg": {k: cfg.get(k) for k in ("shape", "engine", "dtype", "async_decode")}, **r}),
                  flush=True)
    print()
    print_results("gpu", table(rows, a.batch),
                  extra={"bandwidth": bw, "device": name, "results": [[c, r] for c, r in rows]})
    for cfg, r in rows:
        if "error" not in r and cfg["engine"] == "llama" and cfg["dtype"] == "bf16":
            d1 = r["decode_tps"].get("1", r["decode_tps"].get(1))
            print(f"{cfg['shape']} bf16 b=1: {d1 * r['weight_gb'] / bw['read_gbs'] * 100:.0f}% of the measured "
                  f"read bandwidth ({d1 * r['weight_gb']:.0f} of {bw['read_gbs']:.0f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
