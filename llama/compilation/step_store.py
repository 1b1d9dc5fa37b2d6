"""Compiled decode steps kept on disk as AOTInductor packages, so a new process loads in seconds a step that an
earlier process on this machine compiled.

Inductor's own on-disk cache does not help here: with frozen weights prepacked as oneDNN tensors, which it cannot
pickle, every process compiled again. An AOTInductor package holds the compiled step. A step whose weights are
frozen holds its folded weights too; one compiled with freezing off (where the step calls our CPU kernels on the
model's own weights, llama/compilation/compiled_decode.py) holds none: at load the model's tensors are bound to it by name
(user-managed constants), so nothing is copied. The KV cache is not in it either: the step takes the cache
tensors as inputs and writes them in place, so it always works on the model's current cache. Calls of our ops go
through AOTInductor's proxy executor, whose description is kept beside the library.

Key: a fingerprint of the weights (shapes, dtypes and a strided sample of every tensor), the model's arguments, the
batch size, whether rows are given, Inductor's settings, the PyTorch version and the CPU capability. Packages live in
`$LLAMA_CACHE/aoti/` (default ~/.cache/llama); `LLAMA_COMPILE_CACHE=0` turns them off (torch.compile is used as
before). CPU and a single process only: a model-parallel step holds collectives, and CUDA uses CUDA graphs; and
not oneDNN's int8-dynamic (int8-dynamic off x86), whose prepacked weights torch.export cannot trace, nor a model
with MoE layers (their grouping runs eagerly between graphs: llama/moe.py).
A package that cannot be read is rebuilt; one that cannot be built or written falls back to torch.compile."""

import hashlib
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

from llama.distributed import parallel
from llama import settings
from llama.kernels import cpu
from llama.settings import cache_dir

FORMAT = 4  # bump when what a stored step holds or how it is called changes (4: the KV pool's block table)
SAMPLE = 4096  # elements of each tensor that go into the fingerprint
SO = "step.so"  # what a stored step keeps of its AOTInductor package: the shared library (frozen weights included)
CALLS = "step.json"  # and the calls of ops from other libraries (ours), beside it where the loader looks for them
SIZE = "step.size"  # the library's size in bytes


def enabled(model) -> bool:
    """Whether this model's compiled steps are kept on disk: CPU, one process, not turned off, and no oneDNN-packed
    weights (int8-dynamic's opaque tensors off x86, which torch.export cannot trace), and no MoE layers (they run
    eagerly between graphs, which an exported step cannot)."""
    if not settings.get().compile_cache or model.params.moe is not None:
        return False
    return model.norm.weight.device.type == "cpu" and parallel.model_parallel_size() == 1 \
        and parallel.pipeline_parallel_size() == 1 and not any(b.is_mkldnn for b in model.buffers())


def is_cache(name: str) -> bool:
    return name.endswith(("cache_k", "cache_v", "cache_k_scales", "cache_v_scales", "block_table"))


@torch.no_grad()
def fingerprint(model) -> str:
    """A hash of the weights that costs milliseconds: every tensor's name, shape, dtype and SAMPLE strided values.

    Two checkpoints that differ only where no sample falls would collide; weights edited after loading are not
    supported by compiled steps in any case (a frozen graph holds its own copy).
    """
    h = hashlib.sha256(repr(model.params).encode())
    named = dict(model.named_parameters())
    named.update((k, b) for k, b in model.named_buffers() if b is not None and not is_cache(k))
    for name in sorted(named):
        t = named[name]
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        if t.is_mkldnn or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE]
        h.update(sample.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def package_path(weights: str, batch: int, rows: bool, config: Dict) -> Path:
    h = hashlib.sha256(f"{FORMAT}|{weights}|{batch}|{rows}|{json.dumps(config, sort_keys=True)}|"
                       f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}".encode())
    return cache_dir() / "aoti" / h.hexdigest()[:32]


def stored(path: Path) -> bool:
    return (path / SO).is_file()


class _Step(torch.nn.Module):
    """decode_step with the KV cache as inputs, which torch.export needs.

    The caches must not be the model's buffers while exporting: frozen buffers become constants, and a cache that
    is all zeros then is folded away (measured: wrong logits from the package). As inputs, they are mutated in place.
    """

    def __init__(self, model, rows: bool):
        super().__init__()
        self.model, self.rows = model, rows
        self.traced = model.decode_step  # what torch.export traces (as compile.py hands it to torch.compile)

    def forward(self, tokens, pos, *rest):
        rows, caches = (rest[0], rest[1:]) if self.rows else (None, rest)  # a None input would upset the package
        attns = [layer.attention for layer in self.model.layers]
        for i, attn in enumerate(attns):
            attn.cache_k, attn.cache_v, attn.block_table = caches[2 * i], caches[2 * i + 1], caches[-1]
        return self.traced(tokens, pos, rows)


def caches(model) -> list:
    """Every layer's keys and values, then the paged pool's block table (one for all layers)."""
    kv = [t for layer in model.layers for t in (layer.attention.cache_k, layer.attention.cache_v)]
    return kv + [model.layers[0].attention.block_table]


def external(config: Dict) -> bool:
    """Whether a step compiled with these settings takes the model's own weights at load (freezing off: the graph
    calls our kernels on them) rather than holding frozen, prepacked copies."""
    return not config.get("freezing", True)


def build(model, path: Path, inputs: tuple, config: Dict) -> None:
    """Export the decode step for these inputs' shapes, compile it ahead of time and store the package's shared
    library in the directory `path`, atomically (a concurrent reader sees no directory or a whole one).

    Only the library is kept (with its calls of our ops, if any): loading it directly skips unzipping the package
    into a temporary directory on every load, which cost as long again as loading when the library held the
    weights. Unfrozen steps leave the weights out of the package altogether: Loaded binds the model's own."""
    kv = caches(model)
    attns = [layer.attention for layer in model.layers]
    try:
        for attn in attns:  # the caches exist only as the step's inputs while exporting
            attn.cache_k = attn.cache_v = attn.block_table = None
        tokens, pos, rows = (None if t is None else t.contiguous() for t in inputs)
        given = (tokens, pos) if rows is None else (tokens, pos, rows)
        ep = torch.export.export(_Step(model, rows is not None).eval(), (*given, *kv), strict=False)
    finally:
        for i, attn in enumerate(attns):
            attn.cache_k, attn.cache_v, attn.block_table = kv[2 * i], kv[2 * i + 1], kv[-1]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    package = tmp.with_suffix(".pt2")
    try:
        # weights appended to the library and memory-mapped at load, not copied out of its data section
        config = {**config, "aot_inductor.force_mmap_weights": True,
                  "aot_inductor.package_constants_in_so": not external(config)}
        torch._inductor.aoti_compile_and_package(ep, package_path=str(package), inductor_configs=config)
        with zipfile.ZipFile(package) as z:
            [member] = [m for m in z.namelist() if m.endswith(".so")]
            calls = member[: -len(".so")] + ".json"  # the proxy executor's description of our ops' calls
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for name, out in ((member, SO), (calls, CALLS)):
                if name in z.namelist():
                    with z.open(name) as src, open(tmp / out, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 24)
        # its size, checked before loading: the dynamic loader kills the process (SIGBUS) on a truncated library
        (tmp / SIZE).write_text(str((tmp / SO).stat().st_size))
        shutil.rmtree(path, ignore_errors=True)  # an unreadable earlier one
        os.replace(tmp, path)
    finally:
        package.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)


def bound_tensors(model) -> Dict[str, torch.Tensor]:
    """Every name of each of the model's tensors, aliases included: a tied model's output.weight is its embedding's
    Parameter, which named_parameters() lists once (under tok_embeddings), yet the step may name it output.weight."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


class Loaded:
    """A stored step, loaded: callable like decode_step (tokens, pos, rows or None), reading and writing the
    model's current KV cache tensors."""

    def __init__(self, model, path: Path, config: Dict):
        self.model = model
        if (path / SO).stat().st_size != int((path / SIZE).read_text()):
            raise ValueError(f"{path / SO} is not the size it was written with")
        if (path / CALLS).exists() and not cpu.available():  # the ops it calls must be registered
            raise ValueError("the stored step calls llama's CPU kernels, which are not available")
        self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path / SO), 1)
        if external(config):  # the model's own tensors, by name: nothing copied
            named = bound_tensors(model)
            fqns = self.runner.get_constant_names_to_original_fqns()
            missing = [fqn for fqn in fqns.values() if fqn.removeprefix("model.") not in named]
            if missing:
                raise ValueError(f"the stored step names tensors this model lacks: {missing[:3]}")
            self.runner.update_constant_buffer({k: named[fqn.removeprefix("model.")] for k, fqn in fqns.items()},
                                               False, True, True)  # active buffer, every one given, user-managed

    def __call__(self, tokens, pos, rows=None):
        # flat inputs in the exported order; the kernels assume the exported (contiguous) strides
        given = [tokens.contiguous(), pos.contiguous()] + ([] if rows is None else [rows.contiguous()])
        return self.runner.run(given + caches(self.model))[0]


def get(model, weights: str, inputs: tuple, config: Dict) -> Tuple[Optional[Callable], bool]:
    """The step for these inputs' shapes (tokens, pos, rows or None) and whether it was on disk already: loaded
    from the cache, else compiled, stored and loaded; (None, False) when that fails (the caller uses
    torch.compile)."""
    path = package_path(weights, inputs[0].shape[0], inputs[2] is not None, config)
    if stored(path):
        try:
            return Loaded(model, path, config), True
        except Exception as e:  # a truncated or foreign file: build it again
            note(f"ignoring the unreadable compiled step {path} ({e.__class__.__name__}); compiling again")
    try:
        build(model, path, inputs, config)
        return Loaded(model, path, config), False
    except Exception as e:
        note(f"could not keep the compiled decode step in {path.parent} ({e.__class__.__name__}: "
             f"{str(e).splitlines()[0][:200] if str(e) else ''}); compiling it for this process only")
        return None, False


def note(msg: str) -> None:
    if parallel.is_main_process():
        print(f"note: {msg}", file=sys.stderr)
