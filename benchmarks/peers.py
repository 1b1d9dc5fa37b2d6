"""The same workload through transformers and llama.cpp, on the same weights (bench.py's --compare).

Both are optional benchmark dependencies, imported only here: `pip install transformers` (check with
`pip install --dry-run` that it leaves torch alone) and `pip install llama-cpp-python gguf` (builds llama.cpp from
source). Meta's q/k rows are permuted into transformers' rotate-half layout; llama.cpp's GGUF keeps Meta's
interleaved layout, so its tensors are written unchanged (f32/bf16; q8_0/q4_0 made from the bf16 file by
llama.cpp's own quantizer).
"""

import sys
import time
from pathlib import Path

import torch
from harness import DTYPES, best_time, peak_rss, prompt_tokens, step_times, summarize


def meta_state(ckpt: str):
    from llama.formats.meta_checkpoint import load_state_dict, read_params
    from llama.model import ModelArgs

    params = read_params(ckpt)
    args = ModelArgs.from_params(params)
    return args, load_state_dict(ckpt, args, 0, 1)


def hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's interleaved rotary pairs -> transformers' rotate-half halves (convert_llama_weights_to_hf)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def run_hf(cfg: dict) -> dict:
    """transformers' LlamaForCausalLM with generate() (greedy, default cache), weights converted in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    P, N, batches, repeat = cfg["prompt"], cfg["gen"], cfg["batch"], cfg["repeat"]
    dtype = DTYPES[cfg["dtype"]]
    start = time.perf_counter()
    args, meta = meta_state(cfg["ckpt"])
    conf = LlamaConfig(hidden_size=args.dim, intermediate_size=args.hidden_dim, num_hidden_layers=args.n_layers,
                       num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                       vocab_size=args.vocab_size, rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
                       max_position_embeddings=P + N, tie_word_embeddings=False, dtype=dtype)
    with no_init_weights():
        model = LlamaForCausalLM(conf)
    hf = {"model.embed_tokens.weight": meta["tok_embeddings.weight"], "model.norm.weight": meta["norm.weight"],
          "lm_head.weight": meta["output.weight"]}
    for i in range(args.n_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        hf[p + "self_attn.q_proj.weight"] = hf_permute(meta[m + "attention.wq.weight"], args.n_heads)
        hf[p + "self_attn.k_proj.weight"] = hf_permute(meta[m + "attention.wk.weight"], args.n_kv_heads)
        for a, b in (("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
                     ("mlp.gate_proj", "feed_forward.w1"), ("mlp.up_proj", "feed_forward.w3"),
                     ("mlp.down_proj", "feed_forward.w2"), ("input_layernorm", "attention_norm"),
                     ("post_attention_layernorm", "ffn_norm")):
            hf[p + a + ".weight"] = meta[m + b + ".weight"]
    model.load_state_dict({k: v.to(dtype) for k, v in hf.items()}, strict=False)
    del meta, hf
    model.to(dtype).eval()
    out = {"load_s": time.perf_counter() - start, "load_rss": peak_rss()}
    prompt = prompt_tokens(args.vocab_size, P)
    x = torch.tensor([prompt])
    with torch.inference_mode():
        model(x)
        out["prefill_tps"] = P / best_time(lambda: model(x), repeat)

        def run(b, n):
            ids = x.expand(b, -1)
            times = [time.perf_counter()]
            streamer = _Times(times)
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, streamer=streamer)
            return times

        out["decode_tps"] = {}
        for b in batches:
            run(b, 3)
            r = summarize([run(b, N) for _ in range(repeat)], b)
            if b == 1:
                out["ttft_ms"] = r["ttft_ms"]
            out["decode_tps"][b] = r["decode_tps"]
    out["weight_bytes"] = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                              if "embed_tokens" not in n)
    out["rss"] = peak_rss()
    return out


class _Times:
    """A generate() streamer that only records when each new token arrives (its first put is the prompt)."""

    def __init__(self, times):
        self.times, self.prompt_seen = times, False

    def put(self, value):
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass


# --------------------------------------------------------------------------------------------- llama.cpp
GGUF_NAMES = {"attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
              "attention.wo": "attn_output", "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down",
              "feed_forward.w3": "ffn_up", "attention_norm": "attn_norm", "ffn_norm": "ffn_norm"}


def write_gguf(ckpt: str, tokenizer: str, path: Path, qtype: str) -> Path:
    """Meta checkpoint -> GGUF (llama architecture), 2-D tensors as qtype (f32 or bf16), norms f32; gguf_file makes
    the quantized types from the bf16 file with llama.cpp's quantizer."""
    import gguf
    import numpy as np
    from sentencepiece import SentencePieceProcessor

    args, meta = meta_state(ckpt)
    qt = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16}[qtype]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16}[qtype]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(4096)
    w.add_embedding_length(args.dim)
    w.add_block_count(args.n_layers)
    w.add_feed_forward_length(args.hidden_dim)
    w.add_rope_dimension_count(args.head_dim)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_rope_freq_base(args.rope_theta)
    w.add_file_type(ftype)
    sp = SentencePieceProcessor(model_file=tokenizer)
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i).encode())
        scores.append(sp.get_score(i))
        types.append(gguf.TokenType.CONTROL if sp.is_control(i) else gguf.TokenType.UNKNOWN if sp.is_unknown(i)
                     else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())

    def add(name, t):
        a = t.float().numpy()
        if a.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)

    add("token_embd.weight", meta["tok_embeddings.weight"])
    add("output_norm.weight", meta["norm.weight"])
    add("output.weight", meta["output.weight"])
    for i in range(args.n_layers):
        for src, dst in GGUF_NAMES.items():
            add(f"blk.{i}.{dst}.weight", meta[f"layers.{i}.{src}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run_llamacpp(cfg: dict) -> dict:
    """llama.cpp through llama-cpp-python, batch 1 only (the binding decodes one sequence)."""
    import llama_cpp

    P, N, repeat = cfg["prompt"], cfg["gen"], cfg["repeat"]
    path = gguf_file(cfg, cfg["gguf_type"])
    start = time.perf_counter()
    llm = llama_cpp.Llama(str(path), n_ctx=P + N + 8, n_batch=max(P, 32), n_threads=torch.get_num_threads(),
                          n_threads_batch=torch.get_num_threads(), verbose=False)
    out = {"load_s": time.perf_counter() - start, "load_rss": peak_rss(), "gguf_type": cfg["gguf_type"]}
    prompt = prompt_tokens(llm.n_vocab(), P)

    def prefill():
        llm.reset()
        llm.eval(prompt)

    prefill()
    out["prefill_tps"] = P / best_time(prefill, repeat)

    def run(n):
        llm.reset()  # no reuse of the previous run's prompt cache: every run prefills
        tokens = llm.generate(prompt, top_k=1, temp=0.0, reset=True)
        return step_times(next(tokens) for _ in range(n))

    run(3)
    r = summarize([run(N) for _ in range(repeat)], 1)
    out["ttft_ms"], out["decode_tps"] = r["ttft_ms"], {1: r["decode_tps"]}
    out["weight_bytes"] = sum(int(t.n_bytes) for t in _gguf_tensors(path) if t.name != "token_embd.weight")
    out["rss"], out["checkpoint_bytes"] = peak_rss(), path.stat().st_size
    return out


def gguf_file(cfg: dict, qtype: str) -> Path:
    """The checkpoint as GGUF in the workdir, written once: f32/bf16 by write_gguf, q8_0/q4_0 from the bf16 file by
    llama.cpp's own quantizer (llama_model_quantize), as a llama.cpp user would make them."""
    path = Path(cfg["workdir"]) / f"{Path(cfg['ckpt']).name}-{qtype}.gguf"
    if not path.exists():
        tmp = path.with_suffix(".partial")
        start = time.perf_counter()
        if qtype in ("q8_0", "q4_0"):
            llamacpp_quantize(gguf_file(cfg, "bf16"), tmp, qtype)
        else:
            write_gguf(cfg["ckpt"], cfg["tokenizer"], tmp, qtype)
        tmp.rename(path)
        print(f"wrote {path} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return path


def llamacpp_quantize(src: Path, dst: Path, qtype: str) -> None:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[qtype]
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {qtype}")


def _gguf_tensors(path: Path):
    import gguf

    return gguf.GGUFReader(str(path)).tensors
