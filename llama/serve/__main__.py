"""python -m llama.serve [--ckpt_dir DIR] [--tokenizer_path P] [--host 127.0.0.1] [--port 8000] ...

Without --ckpt_dir it serves the default model (SmolLM2-135M-Instruct, fetched once, as the examples do) and says
so in one line.

Under torchrun, rank 0 serves HTTP and drives the engine; the other ranks build the same model and replay rank
0's steps (Engine.serve_forever) until it shuts down.
"""

import argparse
import os
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    from llama.quantization import schemes as quantization  # the registered schemes' names

    p = argparse.ArgumentParser(prog="python -m llama.serve", description="OpenAI-compatible server for a Llama "
                                "checkpoint: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics "
                                "and a chat page at /")
    p.add_argument("--ckpt_dir", "--ckpt-dir", default=None,
                   help="Meta checkpoint directory or GGUF file/dir (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--tokenizer_path", "--tokenizer-path", default=None,
                   help="default: CKPT_DIR/tokenizer.model (a GGUF file carries its own)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max_batch_size", "--max-batch-size", type=int, default=8, help="KV-cache slots")
    p.add_argument("--max_seq_len", "--max-seq-len", type=int, default=2048, help="positions per slot")
    p.add_argument("--api-key", "--api_key", action="append", default=[], dest="api_keys",
                   help="accept this bearer key (repeatable; also LLAMA_API_KEY); none: no authentication")
    p.add_argument("--max-queue", "--max_queue", type=int, default=256, dest="max_queue",
                   help="sequences that may wait for a slot; beyond that requests get 429 with Retry-After")
    p.add_argument("--model-name", "--model_name", default=None, dest="model_name",
                   help="the model id clients send (default: the checkpoint directory's name)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the loader's choice)")
    p.add_argument("--quantize", default=None, choices=quantization.choices())
    p.add_argument("--group_size", "--group-size", type=int, default=None, help="int4's inputs per scale (32)")
    p.add_argument("--model_parallel_size", "--model-parallel-size", type=int, default=None,
                   help="tensor-parallel ranks per stage (default: the world size / pipeline size)")
    p.add_argument("--pipeline_parallel_size", "--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages under torchrun (docs/pipeline.md)")
    p.add_argument("--compile", default="false",
                   help="false (default: a compile runs in the engine's thread and would stall every stream while it "
                        "lasts, minutes on a small CPU), auto, true, default, max-autotune")
    p.add_argument("--prefill_chunk", "--prefill-chunk", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-level", default="info", dest="log_level")
    p.add_argument("--kv-cache-memory", "--kv_cache_memory", default=None, dest="kv_cache_memory",
                   help="bytes of the paged KV pool, e.g. 4GiB (default: max_batch_size x max_seq_len positions)")
    p.add_argument("--prefix-cache", "--prefix_cache", default="on", choices=["on", "exact", "off"],
                   dest="prefix_cache", help="reuse cached prompt prefixes (exact: only prefill-computed positions)")
    p.add_argument("--speculative", default="off", choices=["off", "ngram"],
                   help="ngram: prompt-lookup speculative decoding, outputs unchanged (llama/core/speculative.py)")
    p.add_argument("--draft-model", "--draft_model", default=None, dest="draft_model",
                   help="a smaller checkpoint with the same tokenizer drafts for speculative decoding, outputs "
                        "unchanged (llama/core/draft_model.py)")
    p.add_argument("--kv-cache-dtype", "--kv_cache_dtype", default=None, choices=["int8"], dest="kv_cache_dtype",
                   help="int8 keys/values: each head rotated, then q8_0 (default: the model's dtype)")
    p.add_argument("--share-prefix-cache", action="store_true", dest="share_prefix_cache",
                   help="API keys share cached prefixes (default: each key its own, as timing leaks between them)")
    p.add_argument("--tool-style", "--tool_style", default=None, choices=["llama3_json", "pythonic"], dest="tool_style",
                   help="Meta Llama 3 checkpoints' tool-call syntax (default by shape: 3.2 1B/3B pythonic, else JSON; "
                        "pass pythonic for 3.3)")
    args = p.parse_args(argv)
    if args.max_queue < 0:
        p.error("--max-queue must be >= 0")
    args.compile = {"true": True, "false": False}.get(str(args.compile).lower(), args.compile)
    from llama import settings

    env_key = settings.get().api_key
    if env_key:
        args.api_keys.append(env_key)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from llama.cli.launch import resolve_checkpoint
    from llama.formats import fetch
    from llama.generation import Llama

    try:
        ckpt_dir, tokenizer_path, default = resolve_checkpoint(args.ckpt_dir, args.tokenizer_path)
    except ValueError as e:
        sys.exit(f"error: {e}")

    def load():
        return Llama.build(ckpt_dir=ckpt_dir, tokenizer_path=tokenizer_path, max_seq_len=args.max_seq_len,
                           max_batch_size=args.max_batch_size, seed=args.seed, dtype=args.dtype,
                           compile=args.compile, quantize=args.quantize, group_size=args.group_size,
                           model_parallel_size=args.model_parallel_size,
                           pipeline_parallel_size=args.pipeline_parallel_size,
                           kv_cache_memory=args.kv_cache_memory, prefix_cache=args.prefix_cache,
                           kv_cache_dtype=args.kv_cache_dtype, tool_style=args.tool_style,
                           speculative=None if args.speculative == "off" else args.speculative,
                           draft_model=args.draft_model)

    if int(os.environ.get("RANK", "0")) != 0:  # a model-parallel follower: replay rank 0's steps
        load().engine(prefill_chunk=args.prefill_chunk).serve_forever()
        return
    try:
        import uvicorn

        from llama.serve.app import create_app
    except ImportError as e:
        sys.exit(f"llama.serve needs the serve extra ({e.name} is missing): pip install -e '.[serve]'")
    name = args.model_name or (fetch.NAME if default else Path(ckpt_dir.rstrip("/")).name)
    app = create_app(load, name, args.api_keys, args.max_queue, prefill_chunk=args.prefill_chunk,
                     share_prefix_cache=args.share_prefix_cache)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
