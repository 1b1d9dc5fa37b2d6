"""Loading a generator's parts: checkpoint -> model (cast, fused, quantized, compiled policy) and tokenizer.

Works in plain python and under torchrun, on CPU or CUDA: the device and the process group's backend are picked
at run time (llama/parallel.py).
"""

import time
from typing import Optional, Tuple, Union

import torch

from . import checkpoint, parallel
from . import compile as compilation
from . import quantize as quantization
from . import gguf_checkpoint, memory, quant_checkpoint, tokenizer_hf
from .model import ModelArgs, Transformer, check_model_parallel
from .params import positive_int
from .tokenizer import load_tokenizer


def check_options(max_seq_len, max_batch_size, seed, compile, quantize) -> None:
    positive_int("max_seq_len", max_seq_len)
    positive_int("max_batch_size", max_batch_size)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if quantize is not None and quantize not in quantization.SCHEMES:
        raise ValueError(f"quantize must be one of {quantization.SCHEMES} or None, got {quantize!r}")
    if not any(compile is v for v in (False, None, True)) and compile not in compilation.MODES:
        raise ValueError(f"compile must be a bool, None or one of {compilation.MODES}, got {compile!r}")


def gguf_state(reader, path, args: ModelArgs, rank: int, world_size: int, dtype) -> dict:
    """This rank's slice of a GGUF file's weights, dequantized straight to dtype (a missing output.weight is the
    embedding: shared at world size 1, cut along the vocabulary above)."""
    check_model_parallel(args, world_size)
    full = gguf_checkpoint.read_state_dict(reader, path, dtype)
    checkpoint.check_shapes({k: tuple(v.shape) for k, v in full.items()}, args, str(path))
    state = {name: checkpoint.split_tensor(name, t, rank, world_size) for name, t in full.items()}
    if "output.weight" not in state:
        state["output.weight"] = (state["tok_embeddings.weight"] if world_size == 1 else
                                  checkpoint.split_tensor("output.weight", full["tok_embeddings.weight"], rank, world_size))
    return state


def load(
    ckpt_dir: str,
    tokenizer_path: Optional[str],
    max_seq_len: int,
    max_batch_size: int,
    model_parallel_size: Optional[int] = None,
    seed: int = 1,
    device: Optional[Union[str, torch.device]] = None,
    dtype: Optional[Union[str, torch.dtype]] = None,
    verify: bool = False,
    compile: Union[bool, str, None] = "auto",
    quantize: Optional[str] = None,
    rope_scaling_factor: Optional[float] = None,
    group_size: Optional[int] = None,
) -> Tuple[Transformer, object, Optional[compilation.CompiledDecode]]:
    """(model, tokenizer, compiled decode policy or None) for Llama.build; see its docstring for the options.

    The KV cache is not allocated here: the generator that owns it does (llama/cache.py).
    """
    check_options(max_seq_len, max_batch_size, seed, compile, quantize)
    gguf_path = gguf_checkpoint.find_gguf(ckpt_dir)
    stored = None if gguf_path is not None else quant_checkpoint.stored_scheme(ckpt_dir)
    if stored is not None:  # written by `python -m llama.quantize`: load as it is
        quantize, group_size = quant_checkpoint.check_request(ckpt_dir, stored, quantize, group_size)
    if group_size is not None and quantize != "int4":
        raise ValueError(f"group_size applies to quantize='int4' only, got group_size={group_size!r} with "
                         f"quantize={quantize!r}")
    device = torch.device(device) if device is not None else parallel.default_device()
    bf16 = dtype is None and quantize in ("int8", "int4")  # their CPU kernels want bf16 activations
    dtype = parallel.resolve_dtype(torch.bfloat16 if bf16 else dtype, device)
    start = time.time()
    mp_size = parallel.init_distributed(model_parallel_size, device)
    torch.manual_seed(seed)  # every rank seeds alike, so unseeded sampling agrees across ranks

    if gguf_path is not None:  # one file: hyperparameters, weights and (unless one is given) the tokenizer
        reader = gguf_checkpoint.open_reader(gguf_path)
        params = gguf_checkpoint.read_params(reader, gguf_path)
        tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else tokenizer_hf.from_gguf(reader, gguf_path)
    else:
        if tokenizer_path is None:
            raise ValueError(f"tokenizer_path is needed for {ckpt_dir} (only a GGUF file carries its tokenizer)")
        tokenizer = load_tokenizer(tokenizer_path)
        params = checkpoint.read_params(ckpt_dir)
        params.pop(quant_checkpoint.PARAMS_KEY, None)
    overrides = {}
    if rope_scaling_factor is not None:
        if isinstance(rope_scaling_factor, bool) or not isinstance(rope_scaling_factor, (int, float)) \
                or not 1 <= rope_scaling_factor < float("inf"):
            raise ValueError(f"rope_scaling_factor must be a finite number >= 1, got {rope_scaling_factor!r}")
        overrides = {"rope_scaling_factor": float(rope_scaling_factor), "use_scaled_rope": True}
    try:
        args = ModelArgs.from_params(params, max_seq_len=max_seq_len, max_batch_size=max_batch_size, **overrides)
    except TypeError as e:
        raise ValueError(f"{ckpt_dir}/params.json has invalid values: {e}") from None
    if args.vocab_size == -1:
        args.vocab_size = tokenizer.n_words
    if args.vocab_size != tokenizer.n_words:
        raise ValueError(
            f"{'params.json' if gguf_path is None else gguf_path} vocab_size is {args.vocab_size} but the tokenizer "
            f"{tokenizer_path or gguf_path} has "
            f"{tokenizer.n_words} tokens: they do not belong together"
        )
    memory.check_fits(args, dtype, quantize, group_size, compile, mp_size, device)
    if verify and gguf_path is None:
        checkpoint.verify_checklist(ckpt_dir)
    if stored is not None:
        model = quant_checkpoint.load_model(ckpt_dir, args, parallel.model_parallel_rank(), mp_size, stored)
        model.to(device=device).eval()
        quantization.cast_floating(model, dtype)
        compiled = compilation.compile_decode(model, compile)
        if parallel.is_main_process():
            print(f"Loaded in {time.time() - start:.2f} seconds")
        return model, tokenizer, compiled
    if gguf_path is not None:
        state = gguf_state(reader, gguf_path, args, parallel.model_parallel_rank(), mp_size, dtype)
    else:
        state = checkpoint.load_state_dict(ckpt_dir, args, parallel.model_parallel_rank(), mp_size)
    with torch.device("meta"):
        model = Transformer(args)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint in {ckpt_dir} does not match its params.json: {e}") from None
    del state  # the model owns the tensors now: lets casting and fusing free the originals
    tied = model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()  # no output.weight in the files
    if tied:  # one Parameter for both, so moving to the device makes one copy, not two
        model.output.weight = model.tok_embeddings.weight
    model.to(device=device).eval()
    model.fuse()
    if quantize is not None:  # from the checkpoint's dtype: no full-size fp32 copy on the way
        quantization.quantize(model, quantize, group_size)
    quantization.cast_floating(model, dtype)
    if tied and model.output.scales is None:  # casting copied each: share the embedding again
        model.output.weight = model.tok_embeddings.weight
    compiled = compilation.compile_decode(model, compile)
    if parallel.is_main_process():
        print(f"Loaded in {time.time() - start:.2f} seconds")
    return model, tokenizer, compiled
