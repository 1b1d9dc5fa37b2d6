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

from llama.cli.build_flags import add_model_flags, add_serving_flags, build_args


def parse_args(argv=None) -> argparse.Namespace:
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
    add_model_flags(p)
    add_serving_flags(p)
    p.add_argument("--prefill_chunk", "--prefill-chunk", type=int, default=128)
    p.add_argument("--log-level", default="info", dest="log_level")
    p.add_argument("--share-prefix-cache", action="store_true", dest="share_prefix_cache",
                   help="API keys share cached prefixes (default: each key its own, as timing leaks between them)")
    args = p.parse_args(argv)
    if args.max_queue < 0:
        p.error("--max-queue must be >= 0")
    from llama import settings

    env_key = settings.get().api_key
    if env_key:
        args.api_keys.append(env_key)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from llama.cli.launch import resolve_checkpoint
    from llama.hub import fetch
    from llama.generation import Llama

    try:
        ckpt_dir, tokenizer_path, default = resolve_checkpoint(args.ckpt_dir, args.tokenizer_path)
    except ValueError as e:
        sys.exit(f"error: {e}")

    try:  # every option checked, and the checkpoint's kind read, before the server starts
        options = build_args(args, ckpt_dir, tokenizer_path)
        config = options.resolve()
        draft = None if options.draft_model is None else options.draft().resolve()
    except (ValueError, TypeError) as e:
        sys.exit(f"error: {e}")

    def load():
        return Llama.from_config(config, draft)

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
