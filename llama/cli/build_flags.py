"""The command-line flags of Llama.build's options, shared by the server and the chat CLI: their choice lists come
from the configuration (llama/config/options.py) and the quantization registry, and the parsed flags become one
BuildArgs, resolved once before anything loads."""

import argparse
from typing import Optional

from llama.compilation.compiled_decode import MODES as COMPILE_MODES
from llama.config import BuildArgs
from llama.config.options import KV_CACHE_DTYPES, PREFIX_CACHE_MODES, SPECULATIVE_MODES
from llama.quantization import registry
from llama.tokenizers.chat_format import TOOL_STYLES


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """What both CLIs take: the dtype, quantization and speculation."""
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the loader's choice)")
    p.add_argument("--quantize", default=None, choices=registry.choices())  # the registered schemes (aliases too)
    p.add_argument("--group_size", "--group-size", type=int, default=None, help="int4's inputs per scale (32)")
    p.add_argument("--speculative", default="off", choices=["off", *(m for m in SPECULATIVE_MODES if m != "draft")],
                   help="ngram: prompt-lookup speculative decoding, outputs unchanged (llama/core/speculation/speculative.py)")
    p.add_argument("--draft-model", "--draft_model", default=None, dest="draft_model",
                   help="a smaller checkpoint with the same tokenizer drafts for speculative decoding, outputs "
                        "unchanged (llama/core/speculation/draft_model.py)")


def add_serving_flags(p: argparse.ArgumentParser) -> None:
    """What the server takes besides: parallelism, compiling, and the KV pool."""
    p.add_argument("--model_parallel_size", "--model-parallel-size", type=int, default=None,
                   help="tensor-parallel ranks per stage (default: the world size / pipeline size)")
    p.add_argument("--pipeline_parallel_size", "--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages under torchrun (docs/pipeline.md)")
    p.add_argument("--compile", default="false", type=compile_flag,
                   help="false (default: a compile runs in the engine's thread and would stall every stream while it "
                        f"lasts, minutes on a small CPU), true, {', '.join(COMPILE_MODES)}")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kv-cache-memory", "--kv_cache_memory", default=None, dest="kv_cache_memory",
                   help="bytes of the paged KV pool, e.g. 4GiB (default: max_batch_size x max_seq_len positions)")
    p.add_argument("--prefix-cache", "--prefix_cache", default="on", choices=list(PREFIX_CACHE_MODES),
                   dest="prefix_cache", help="reuse cached prompt prefixes (exact: only prefill-computed positions)")
    p.add_argument("--kv-cache-dtype", "--kv_cache_dtype", default=None, choices=list(KV_CACHE_DTYPES),
                   dest="kv_cache_dtype", help="int8 keys/values: each head rotated, then q8_0 (default: the model's "
                                               "dtype)")
    p.add_argument("--tool-style", "--tool_style", default=None, choices=list(TOOL_STYLES), dest="tool_style",
                   help="Meta Llama 3 checkpoints' tool-call syntax (default by shape: 3.2 1B/3B pythonic, else JSON; "
                        "pass pythonic for 3.3)")


def compile_flag(text: str):
    """--compile's value: true/false as bools, a mode as itself (checked when the configuration is built)."""
    return {"true": True, "false": False}.get(text.lower(), text)


def model_options(args: argparse.Namespace) -> dict:
    """Llama.build's options from add_model_flags' flags."""
    return {"dtype": args.dtype, "quantize": args.quantize, "group_size": args.group_size,
            "speculative": None if args.speculative == "off" else args.speculative, "draft_model": args.draft_model}


def build_args(args: argparse.Namespace, ckpt_dir: str, tokenizer_path: Optional[str], **fixed) -> BuildArgs:
    """The BuildArgs of parsed flags (those the parser has), with `fixed` options the CLI does not offer."""
    options = {name: getattr(args, name) for name in BuildArgs.__dataclass_fields__ if hasattr(args, name)}
    options.update(model_options(args), **fixed, ckpt_dir=ckpt_dir, tokenizer_path=tokenizer_path)
    return BuildArgs.of(**options)
