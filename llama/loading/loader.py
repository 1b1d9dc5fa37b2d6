"""Loading a generator's parts: checkpoint -> model (cast, fused, quantized, compiled policy) and tokenizer.

Works in plain python and under torchrun, on CPU or CUDA: the device and the process group's backend are picked
at run time (llama/distributed/parallel.py).
"""

import time
from typing import Optional, Tuple

import torch
from tqdm import tqdm

from llama import settings
from llama.compilation import compiled_decode
from llama.config.options import LlamaConfig, ModelConfig, QuantConfig, SchedulerConfig
from llama.distributed import parallel, pipeline
from llama.formats import checklist
from llama.formats import gguf_file
from llama.formats import gguf_quants
from llama.formats import hf_checkpoint
from llama.loading import memory
from llama.formats import meta_checkpoint
from llama.loading import preload
from llama.formats import quantized_checkpoint
from llama.kernels import cpu
from llama.kernels import ggml_arith
from llama.layers import Fusable, linear_layers
from llama.model import ModelArgs, Transformer, check_model_parallel
from llama.quantization import schemes
from llama.quantization.schemes import QuantScheme
from llama.tokenizers import huggingface
from llama.tokenizers.sentencepiece import load_tokenizer


def fuses(args: ModelArgs, dtype, device, quantize: Optional[QuantScheme], compile, ranks: int = 1) -> bool:
    """Whether loading fuses q/k/v and gate/up into one product each. Fusing concatenates their weights (a copy)
    for fewer, larger products: on small models that is worth ~8 % eager and ~28 % compiled (134M bf16). Unquantized
    on a CPU where our kernels run (llama/kernels/cpu.py), the copy sits in memory beside the checkpoint's mapped
    pages (a 7B bf16 model peaked at 22.1 GB fused, 13.8 GB not, and loaded in 8.3 s instead of 0.2), so there it
    fuses only when the copy is under a quarter of the available memory, compiled or not (a compiled step calls our
    kernels on the model's weights, fused or not), or a compiled step is asked for under model parallel (its graph
    freezes a copy anyway). Quantized weights are always fused before quantizing (the pack cache keeps them)."""
    if quantize is not None or torch.device(device).type != "cpu" or not cpu.available():
        return True
    if compile is not None and compile is not False and compile != "auto" and ranks > 1:
        return True
    fused = args.dim * (args.n_heads + 2 * args.n_kv_heads) * args.head_dim + 2 * args.dim * args.hidden_dim
    copy = args.n_layers * fused * dtype.itemsize / ranks
    have = memory.available_bytes()
    return have is None or copy <= have / 4


def prepare(module: torch.nn.Module, device, dtype, quantize: Optional[QuantScheme],
            group_size: Optional[int] = None, fuse: bool = True) -> None:
    """Move, fuse (see fuses()), quantize and cast a module in place: the whole model, or one layer as soon as it
    is loaded."""
    module.to(device=device)
    if fuse:
        for m in module.modules():
            if isinstance(m, Fusable):
                m.fuse()
    if quantize is not None:  # from the checkpoint's dtype: no full-size fp32 copy on the way
        schemes.quantize(module, quantize, group_size)
    schemes.cast_floating(module, dtype)


def gguf_model(reader, path, args: ModelArgs, rank: int, world_size: int, device, dtype,
               quantize: Optional[QuantScheme], group_size: Optional[int] = None, fuse: bool = True) -> Transformer:
    """This rank's model from a GGUF file, layer by layer: each layer is dequantized to dtype, sliced, moved,
    fused and quantized, and its file pages released, before the next is read, so a quantized load never holds
    the whole model in full precision, nor the file beside the model. A missing output.weight is the embedding: shared at world size 1, cut along the vocabulary above."""
    check_model_parallel(args, world_size)
    globals_, layers, shapes = gguf_file.layer_groups(reader, path)
    meta_checkpoint.check_shapes(shapes, args, str(path))  # before any weight is dequantized
    if gguf_quants.runs_natively(reader, quantize, device):  # quantized tensors kept in their own blocks
        return gguf_quants.native_model(reader, path, args, rank, world_size, device, dtype, fuse)
    with torch.device("meta"):
        model = Transformer(args)
    # whole tensors already in dtype stay mapped on CPU, their pages kept (gguf_file.in_place) while the model holds
    # them; slices, fused or quantized weights and layers moved to a GPU are copies, whose source pages are released
    keep = dtype if quantize is None and world_size == 1 and torch.device(device).type == "cpu" else None
    full = gguf_file.read_tensors(globals_, path, dtype)
    state = {name: meta_checkpoint.split_tensor(name, t, rank, world_size) for name, t in full.items()}
    if "output.weight" not in state:
        state["output.weight"] = (state["tok_embeddings.weight"] if world_size == 1 else
                                  meta_checkpoint.split_tensor("output.weight", full["tok_embeddings.weight"], rank,
                                                          world_size))
    del full
    gguf_file.release(reader, globals_, keep)
    model.load_state_dict(state, strict=False, assign=True)
    if "output.weight" not in shapes and world_size == 1:  # one Parameter, so .to() keeps one copy
        model.output.weight = model.tok_embeddings.weight
    prepare(model.output, device, dtype, quantize, group_size, fuse)  # quantized now, not held in full precision meanwhile
    big = sum(int(t.n_bytes) for t in reader.tensors) > 1 << 30
    for i in tqdm(range(args.n_layers), desc=f"loading {path.name}", unit="layer", disable=not big):
        prefix = f"layers.{i}."
        layer = {name[len(prefix):]: meta_checkpoint.split_tensor(name, t, rank, world_size)
                 for name, t in gguf_file.read_tensors(layers[i], path, dtype).items()}
        try:
            model.layers[i].load_state_dict(layer, strict=True, assign=True)
        except RuntimeError as e:
            raise ValueError(f"{path}: layer {i} does not match the metadata: {e}") from None
        prepare(model.layers[i], device, dtype, quantize, group_size, fuse)
        # what the layer holds in place keeps its pages; what fusing or repacking copied (a bf16 expert's w1/w3
        # into w13) releases them, else a bf16 MoE file peaked at 1.6x its size
        gguf_quants.release_unused(reader, layers[i], model.layers[i])
    return model


def gguf_stage(reader, path, args: ModelArgs, stage, rank: int, world_size: int,
               dtype, native: bool = False, fuse: bool = True) -> pipeline.PipelineTransformer:
    """This rank's pipeline stage from a GGUF file: only the stage's tensors are read (its layers, plus the
    embedding on the first stage and the output on the last: the embedding table when the file ties them), each
    cut to tensor-parallel slice `rank` of `world_size`, layer by layer, their file pages released once read;
    dequantized, or with `native` kept in their own blocks (gguf_quants.native_model)."""
    pipeline.check_layout(args, world_size, stage.count)
    globals_, layers, shapes = gguf_file.layer_groups(reader, path)
    meta_checkpoint.check_shapes(shapes, args, str(path))  # before any weight is dequantized
    if native:
        with torch.device("meta"):
            model = pipeline.PipelineTransformer(args, stage)
        return gguf_quants.native_model(reader, path, args, rank, world_size, "cpu", dtype, fuse, model, stage.layers)
    tied = "output.weight" not in shapes
    keep = dtype if world_size == 1 else None  # tensor-parallel slices are copies: release what they came from
    state = {}
    for t in globals_:
        name = gguf_file.meta_name(t.name, path)
        names = [n for n in ([name, "output.weight"] if tied and name == "tok_embeddings.weight" else [name])
                 if pipeline.local_name(n, stage) is not None]
        if names:
            full = gguf_file.read_tensors([t], path, dtype)[name]
            state.update({n: meta_checkpoint.split_tensor(n, full, rank, world_size) for n in names})
            gguf_file.release(reader, [t], keep)
    for i in stage.layers:
        for name, t in gguf_file.read_tensors(layers[i], path, dtype).items():
            state[pipeline.local_name(name, stage)] = meta_checkpoint.split_tensor(name, t, rank, world_size)
        gguf_file.release(reader, layers[i], keep)
    with torch.device("meta"):
        model = pipeline.PipelineTransformer(args, stage)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{path}: stage {stage.index} does not match the metadata: {e}") from None
    return model


def load(config: LlamaConfig) -> Tuple[Transformer, object, Optional[compiled_decode.CompiledDecode]]:
    """(model, tokenizer, compiled decode policy or None) for Llama.build, as its resolved configuration says
    (llama/config/).

    The KV cache is not allocated here: the generator that owns it does (llama/core/worker/kv_cache.py).
    """
    m, quant, par = config.model, config.quant, config.parallel
    start = time.time()
    mp_size = parallel.init_distributed(par.model_parallel_size, m.device, par.pipeline_parallel_size)
    torch.manual_seed(m.seed)  # every rank seeds alike, so unseeded sampling agrees across ranks
    reader, params, tokenizer = read_parts(m)
    args = model_args(params, tokenizer, config.scheduler, m.rope_scaling_factor,
                      f"{m.path}/params.json" if m.gguf_path is None else str(m.gguf_path),
                      m.tokenizer_path or m.gguf_path)
    ranks = mp_size * par.pipeline_parallel_size
    # each rank holds about 1/(T x P) of the weights; a GGUF file run in its blocks holds about the file's size
    # (mapped), which the estimate at dtype would overstate several times, so it is not checked (issue 36)
    if reader is None or not gguf_quants.runs_natively(reader, quant.scheme, m.device):
        memory.check_fits(args, m.dtype, quant.scheme, quant.group_size, config.compile.mode, ranks, m.device)
    fuse = fuses(args, m.dtype, m.device, quant.scheme, config.compile.mode, ranks)
    if m.verify and m.kind in ("meta", "quantized"):
        checklist.verify_checklist(m.path)
    rank = parallel.model_parallel_rank()
    if quant.stored is not None:
        model = stored_model(m, args, rank, mp_size, quant)
    else:
        model = float_model(config, args, rank, mp_size, reader, fuse)
    preload.read_weights(model, m.preload, progress=parallel.is_main_process())
    compiled = None if par.staged else compiled_decode.compile_decode(model, config.compile.mode)
    if parallel.is_main_process():
        print(f"Loaded in {time.time() - start:.2f} seconds")
    return model, tokenizer, compiled


def read_parts(m: ModelConfig):
    """(GGUF reader or None, params dict, tokenizer): a GGUF file carries its hyperparameters and (unless one is
    given) its tokenizer; a Hugging Face directory its config.json and tokenizer.json (or tokenizer.model); a
    Meta-layout directory has params.json and needs tokenizer_path."""
    ckpt_dir, tokenizer_path, gguf_path, hf_dir = m.path, m.tokenizer_path, m.gguf_path, m.hf_dir
    if hf_dir is not None:
        params = hf_checkpoint.hf_params(hf_checkpoint.read_config(hf_dir), hf_dir / "config.json")
        return None, params, load_tokenizer(tokenizer_path or hf_checkpoint.tokenizer_file(hf_dir))
    if gguf_path is not None:
        reader = gguf_file.open_reader(gguf_path)
        params = gguf_file.read_params(reader, gguf_path)
        tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else huggingface.from_gguf(reader, gguf_path)
        return reader, params, tokenizer
    if tokenizer_path is None:
        raise ValueError(f"tokenizer_path is needed for {ckpt_dir} (only a GGUF file carries its tokenizer)")
    tokenizer = load_tokenizer(tokenizer_path)
    params = meta_checkpoint.read_params(ckpt_dir)
    params.pop(quantized_checkpoint.PARAMS_KEY, None)
    return None, params, tokenizer


def model_args(params: dict, tokenizer, scheduler: SchedulerConfig, rope_scaling_factor: Optional[float],
               params_source: str, tokenizer_source) -> ModelArgs:
    """ModelArgs from the checkpoint's params, the scheduler's sizes (Meta's ModelArgs carries them) and the rope
    override, checked against the tokenizer's vocabulary."""
    overrides = {}
    if rope_scaling_factor is not None:
        overrides = {"rope_scaling_factor": float(rope_scaling_factor), "use_scaled_rope": True}
    try:
        args = ModelArgs.from_params(params, max_seq_len=scheduler.max_seq_len,
                                     max_batch_size=scheduler.max_batch_size, **overrides)
    except TypeError as e:
        raise ValueError(f"{params_source} has invalid values: {e}") from None
    if args.vocab_size == -1:
        args.vocab_size = tokenizer.n_words
    if args.vocab_size != tokenizer.n_words:
        raise ValueError(
            f"{params_source} vocab_size is {args.vocab_size} but the tokenizer {tokenizer_source} has "
            f"{tokenizer.n_words} tokens: they do not belong together"
        )
    return args


def stored_model(m: ModelConfig, args: ModelArgs, rank: int, mp_size: int, quant: QuantConfig) -> Transformer:
    """This rank's model from a checkpoint written by `python -m llama.quantize`, nothing requantized: int8 codes
    that load as int8-dynamic keep their codes and multiply int8 activations."""
    model = quantized_checkpoint.load_model(m.path, args, rank, mp_size, quant.stored, m.device)
    model.to(device=m.device).eval()
    if quant.scheme is not schemes.get(quant.stored["scheme"]):  # another scheme of the codes (int8-dynamic)
        schemes.quantize(model, quant.scheme)
    schemes.cast_floating(model, m.dtype)
    return model


def float_model(config: LlamaConfig, args: ModelArgs, rank: int, mp_size: int, reader, fuse: bool):
    """This rank's model (or pipeline stage) from a Meta-layout, Hugging Face or GGUF checkpoint, moved, fused,
    quantized and cast (prepare)."""
    m, staged = config.model, config.parallel.staged
    ckpt_dir, gguf_path, device, dtype = m.path, m.gguf_path, m.device, m.dtype
    quantize, group_size = config.quant.scheme, config.quant.group_size
    if staged:  # this rank's stage only: its layers and its tensor-parallel slice of them (llama/distributed/pipeline.py)
        stage = pipeline.current_stage(args.n_layers)
        if gguf_path is not None:
            with memory.freed_memory_returned():
                model = gguf_stage(reader, gguf_path, args, stage, rank, mp_size, dtype,
                                   gguf_quants.runs_natively(reader, quantize, device), fuse)
        elif m.kind == "hf":
            model = hf_model(ckpt_dir, args, rank, mp_size, stage)
        else:
            model = pipeline.load_stage(ckpt_dir, args, stage, rank, mp_size)
    elif gguf_path is not None:
        with memory.freed_memory_returned():
            model = gguf_model(reader, gguf_path, args, rank, mp_size, device, dtype, quantize, group_size, fuse)
    elif m.kind == "hf":
        model = hf_model(ckpt_dir, args, rank, mp_size)
    else:
        state = meta_checkpoint.load_state_dict(ckpt_dir, args, rank, mp_size)
        with torch.device("meta"):
            model = Transformer(args)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise ValueError(f"checkpoint in {ckpt_dir} does not match its params.json: {e}") from None
        del state  # the model owns the tensors now: lets casting and fusing free the originals
    # No output.weight in the files: one table serves both (never on pipeline stages: they sit on different stages)
    tied = not staged and model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    if tied:  # one Parameter for both, so moving to the device makes one copy, not two
        model.output.weight = model.tok_embeddings.weight
    model.eval()
    native = any(isinstance(m.method, gguf_quants.gguf_blocks.GGUFBlocks) for m in linear_layers(model))
    # what layer-by-layer loading has not done yet (block layers were fused by type as they loaded)
    prepare(model, device, dtype, quantize, group_size, fuse and not native)
    if native and settings.get().ggml_arith:  # llama.cpp's logits bit for bit (llama/kernels/ggml_arith.py)
        ggml_arith.enable(model)
    if tied and not model.output.method.quantized:  # casting copied each: share the embedding again
        model.output.weight = model.tok_embeddings.weight
    return model


def hf_model(hf_dir, args: ModelArgs, rank: int, mp_size: int, stage=None):
    """This rank's model (or pipeline stage) from a Hugging Face directory: its tensors renamed and permuted into
    Meta's layout (llama/formats/hf_checkpoint.py), this rank's slice of each."""
    check_model_parallel(args, mp_size)
    if stage is not None:
        pipeline.check_layout(args, mp_size, stage.count)
    state = hf_checkpoint.hf_to_meta(hf_checkpoint.read_hf_weights(hf_dir), args,
                                     tied=bool(hf_checkpoint.read_config(hf_dir).get("tie_word_embeddings")))
    meta_checkpoint.check_shapes({name: tuple(t.shape) for name, t in state.items()}, args, str(hf_dir))
    tied = state.get("output.weight") is state.get("tok_embeddings.weight")
    local = {}
    for name, t in state.items():
        target = name if stage is None else pipeline.local_name(name, stage)
        if target is not None and not (stage is None and tied and name == "output.weight" and mp_size == 1):
            local[target] = meta_checkpoint.split_tensor(name, t, rank, mp_size)
    if stage is None and tied and mp_size == 1:
        local["output.weight"] = local["tok_embeddings.weight"]  # one tensor: float_model shares the Parameter
    with torch.device("meta"):
        model = Transformer(args) if stage is None else pipeline.PipelineTransformer(args, stage)
    try:
        model.load_state_dict(local, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{hf_dir} does not match its config.json: {e}") from None
    return model
