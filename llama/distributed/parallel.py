"""Process group and model-parallel set-up: one code path for plain `python`, torchrun, CPU and CUDA.

The reference hard-codes NCCL and needs torchrun even for one process. Here the device and backend are chosen at
run time (CUDA + nccl when a GPU is present, CPU + gloo otherwise); a single process without torchrun gets an
in-memory store, so no port or environment variable is needed.
"""

import atexit
import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from fairscale.nn.model_parallel import initialize as fs_init
from fairscale.nn.model_parallel.mappings import gather_from_model_parallel_region, reduce_from_model_parallel_region

from llama import settings


def default_device() -> torch.device:
    """$LLAMA_DEVICE when set (cpu, cuda, cuda:N), else cuda:LOCAL_RANK when CUDA is available, else cpu.

    The variable lets a GPU machine run on its CPU (or a test suite pick its device) without changing code.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = settings.get().device
    if device is not None:
        if device.type != "cuda":
            return device
        if not torch.cuda.is_available():
            raise ValueError(f"LLAMA_DEVICE={device} but this PyTorch sees no CUDA device")
        if device.index is not None:
            return device
    elif not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} has no GPU: only {torch.cuda.device_count()} CUDA device(s) visible; "
            "launch at most that many processes per node, or set LLAMA_DEVICE=cpu"
        )
    return torch.device("cuda", local_rank)


_DTYPES = settings.DTYPES


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """bf16 on CUDA when supported (else fp16), fp32 on CPU, unless dtype (or else $LLAMA_DTYPE) says otherwise."""
    if dtype is None:
        dtype = settings.get().dtype
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or the matching torch.dtype, got {dtype!r}")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(model_parallel_size: Optional[int] = None, device: Optional[torch.device] = None,
                     pipeline_parallel_size: int = 1) -> int:
    """Initialise torch.distributed and fairscale model parallel if not done yet; return the model-parallel size.

    Under torchrun the environment (WORLD_SIZE, RANK, MASTER_ADDR...) is used; otherwise a one-process group on an
    in-memory store. pipeline_parallel_size P > 1 (llama/distributed/pipeline.py): the world is exactly T x P ranks, rank
    = stage * T + tensor-parallel rank, so each stage's tensor-parallel group is T consecutive ranks (one node
    under torchrun's --nproc_per_node T).
    """
    device = torch.device(device) if device is not None else default_device()
    if not dist.is_initialized():
        backend = backend_for(device)
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        # A rank that exits with its group open can abort at shutdown and fail the other nodes' launchers.
        atexit.register(_destroy)
    world_size = dist.get_world_size()
    pp = pipeline_parallel_size
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
    if model_parallel_size is None:
        if world_size % pp:
            raise ValueError(f"pipeline_parallel_size {pp} does not divide the world size {world_size} "
                             "(torchrun's nnodes x nproc_per_node)")
        model_parallel_size = world_size // pp
    if pp > 1 and (not isinstance(model_parallel_size, int) or model_parallel_size * pp != world_size):
        raise ValueError(
            f"model_parallel_size ({model_parallel_size!r}) x pipeline_parallel_size ({pp}) must equal the world "
            f"size {world_size} (torchrun's nnodes x nproc_per_node)"
        )
    if not isinstance(model_parallel_size, int) or model_parallel_size < 1 or world_size % model_parallel_size:
        raise ValueError(
            f"model_parallel_size must be a positive divisor of the world size {world_size}, got {model_parallel_size!r}"
        )
    if fs_init.model_parallel_is_initialized():
        current = fs_init.get_model_parallel_world_size(), len(fs_init.get_pipeline_parallel_ranks())
        if current != (model_parallel_size, pp):
            raise ValueError(
                f"model parallel is already initialised with (model, pipeline) sizes {current}, cannot switch to "
                f"{(model_parallel_size, pp)} in the same process"
            )
    else:
        fs_init.initialize_model_parallel(model_parallel_size, pipeline_length=pp)
    return model_parallel_size


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def model_parallel_rank() -> int:
    return fs_init.get_model_parallel_rank()


def model_parallel_size() -> int:
    return fs_init.get_model_parallel_world_size()


def pipeline_parallel_size() -> int:
    """Number of pipeline stages (1 when pipeline parallel is off or nothing is initialised)."""
    return len(fs_init.get_pipeline_parallel_ranks()) if fs_init.model_parallel_is_initialized() else 1


def pipeline_parallel_rank() -> int:
    """This rank's stage: 0 holds the embedding, pipeline_parallel_size() - 1 the final norm and output."""
    if not fs_init.model_parallel_is_initialized():
        return 0
    return fs_init.get_pipeline_parallel_ranks().index(dist.get_rank())


def pipeline_parallel_ranks() -> List[int]:
    """Global ranks of this rank's pipeline group, first stage first (same tensor-parallel rank in each stage)."""
    return list(fs_init.get_pipeline_parallel_ranks())


def lockstep_group() -> Optional[Tuple[Optional[dist.ProcessGroup], int]]:
    """(group, source rank) over which the engine's leader sends each step's ops to the ranks that replay them,
    or None when this process runs alone. Tensor parallel only: the model-parallel group and its first rank.
    With pipeline stages every rank of the job takes part (None: the default group) and global rank 0, on the
    first stage, leads."""
    if not dist.is_initialized() or not fs_init.model_parallel_is_initialized():
        return None
    if pipeline_parallel_size() > 1:
        return None, 0
    if fs_init.get_model_parallel_world_size() > 1:
        return fs_init.get_model_parallel_group(), fs_init.get_model_parallel_src_rank()
    return None


def is_main_process() -> bool:
    """Rank 0 of the whole job: the only one that prints."""
    return not dist.is_initialized() or dist.get_rank() == 0


def reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the model-parallel ranks (row-parallel outputs).

    Eager calls go through fairscale's region functions; inside torch.compile the same collective is a functional
    one, which Inductor can place in the compiled decode step (in-place c10d calls would break the graph).
    """
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, "sum", fs_init.get_model_parallel_group())
    return reduce_from_model_parallel_region(x)


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """The model-parallel ranks' x concatenated along the last dimension (column-parallel outputs, embeddings)."""
    if torch.compiler.is_compiling():
        # Gathered along dim 0 and rearranged here: a gather along another dim calls a helper that Dynamo refuses
        # to trace in some PyTorch releases (2.11).
        group = fs_init.get_model_parallel_group()
        parts = funcol.all_gather_tensor(x.contiguous(), 0, group).chunk(dist.get_world_size(group), dim=0)
        return torch.cat(parts, dim=-1)
    return gather_from_model_parallel_region(x)
