"""torch.compile of the one-token decode step (gpt-fast's approach), for decoding near memory bandwidth.

On CUDA the compiled step also replays as a CUDA graph, as gpt-fast's mode="reduce-overhead" does. The rest of this
note is about the CPU, where most of the measuring was done.

Decoding one sequence reads every weight once per token. Eager matrix-vector products (MKL) reach about half the
machine's bandwidth and every small operator costs a few microseconds; Inductor with max-autotune and freezing
(weights folded in as constants, so they can be prepacked for its own GEMV kernels) gets close to the limit and
fuses the norms, rotary embedding and activations. That needs static shapes: Transformer.decode_step attends
over the whole cache under a mask, so one graph serves every position of a given batch size.

Where our CPU kernels take every linear layer (llama/kernels/cpu.py: unquantized bf16, fp32 up to a few rows,
int4, int8-dynamic), the step calls them on the model's own weights instead, with freezing off: nothing is copied
into the graph (nor into a stored step), a float step compiles in about half the time, and Inductor still fuses
everything around the products.

Costs: compiling takes seconds to tens of seconds per batch size, and frozen weights are copied into the compiled
graph. On the CPU in a single process, a step with frozen weights is kept on disk as an AOTInductor package
(llama/compilation/step_store.py), so a later process loads it in under a second instead of compiling again. Frozen
weights must not change after compiling. Prefill and other calls stay eager. Hence compile="auto", Llama.build's
default, compiles a batch size only once eager decoding at it has cost about what compiling will (CompiledDecode),
or at once when the step is stored, and only when any copy fits in memory.
"""

import time
import warnings
from typing import Callable, Dict, Optional, Union

import torch

from llama import moe
from llama.compilation import step_store
from llama.distributed import parallel
from llama.kernels import cpu
from llama.kernels import fused_decode
from llama.kernels.dense import FP32_KERNEL_MAX_ROWS
from llama.layers import float_kernel_model, kernel_model, linear_layers, quantized

MODES = ("auto", "max-autotune", "default")

# compile="auto" (Llama.build's default) compiles only models at least this large: below it an eager step takes a
# few milliseconds and a compile stall of seconds is never repaid by ordinary use.
AUTO_MIN_PARAMS = 50_000_000

# fp32 batches this large stay eager: oneDNN's eager fp32 GEMM beats Inductor's template there, and smaller
# batches are faster compiled (docs/performance-history.md, "Why these defaults").
FP32_EAGER_MIN_BATCH = 32

# compile="auto" keeps batch sizes up to this eager on CPU when our kernels run the whole model (one tile of their
# rows; unquantized fp32, up to the rows our fp32 kernel takes), for models of EAGER_KERNEL_MIN_BYTES or more, whose
# eager step is almost all weight streaming in our kernels (a compiled step wins back a few percent, after minutes
# of compiling), unless the step is stored on disk (compile=True once): then it loads in seconds and takes those
# few percent. Smaller models, faster compiled, go by the lazy rule (docs/performance-history.md, "Why these defaults").
EAGER_KERNEL_MAX_BATCH = 4
EAGER_KERNEL_MIN_BYTES = 1 << 30

# Inductor's own lowering of oneDNN's int8 linear (int8-dynamic) warns about its internal tensor copy: not ours.
warnings.filterwarnings("ignore", message="To copy construct from a tensor", module="torch._inductor.mkldnn_lowerings")


def inductor_config():
    """torch._inductor.config, imported when a step first compiles: importing it pulls in Dynamo (about 2 s of
    every `import llama` otherwise)."""
    import torch._inductor.config as config

    return config


class CompiledDecode:
    """Transformer.decode_step under torch.compile, one graph per padded batch size (and per rows given or not).

    lazy=True is compile="auto"'s ski-rental rule: a batch size keeps decoding eagerly (ready() says no, the runner
    runs the eager step and reports its time with spent_eager) until the eager time spent at that size
    reaches what compiling it is expected to cost; then it compiles. Total time is thus never more than twice that
    of the better choice made in hindsight, and a long-running generator or server ends up compiled. The expected
    cost starts as an estimate from the weights' size and becomes the measured time once a graph has compiled.
    """

    def __init__(self, model, mode: str = "auto", lazy: bool = False):
        if mode not in MODES:
            raise ValueError(f"compile mode must be one of {MODES}, got {mode!r}")
        if mode == "auto":
            mode = auto_mode(model)
        self.cuda = model.norm.weight.device.type == "cuda"
        # Set around every call, not as torch.compile options: Inductor reads `freezing` outside the options' scope.
        self.config = {"freezing": True, "max_autotune": mode == "max-autotune",
                       # Only Inductor's own GEMM template: picking between it and ATen's by timing them once is
                       # at the mercy of a noisy machine, and a bad pick is cached on disk for later runs. The
                       # template won every fp32 case measured, batch 1 to 32 (docs/performance.md).
                       "max_autotune_gemm_backends": "CPP",
                       # no per-GEMM autotuning tables on stderr
                       "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
        if self.cuda:
            # gpt-fast's recipe: the step replays as one CUDA graph (a decode step is hundreds of small kernels
            # whose launches would cost more than the GPU's work), and Triton's kernels are tuned per shape.
            # No freezing: on CUDA it folds a transposed copy of every weight into each graph (measured: 42 GiB
            # peak for a 13.5 GB model compiled at three batch sizes, and matrix-vector products at half speed).
            self.config.update({"freezing": False, "triton.cudagraphs": True, "coordinate_descent_tuning": True,
                                "max_autotune_gemm_backends": "ATEN,TRITON"})
        # Weights in our kernels stay out of the graph: the step calls them on the model's own tensors, so nothing
        # is frozen, prepacked or copied (a frozen graph held a copy of every float weight, and a stored one of
        # every weight).
        self.outside = not self.cuda and kernel_model(model)
        if self.outside:
            self.config["freezing"] = False
        # fp32 batches this large stay eager where they would not run in Inductor's frozen-weight GEMM template
        self.fp32_gemm_eager = mode == "max-autotune" or (
            self.outside and float_kernel_model(model) and model.norm.weight.dtype == torch.float32)
        self.model, self.mode, self.lazy = model, mode, lazy
        if not self.outside:  # our kernels read a view at its offset; only frozen templates need their own storage
            own_storage(model)
        self.seen: Dict[tuple, float] = {}  # (batch size, rows given) -> seconds the first call took
        self.packages: Dict[tuple, Callable] = {}  # keys whose step runs from an AOTInductor package
        self.eager: Dict[tuple, float] = {}  # lazy: eager decode seconds spent per key so far
        self.refused: set = set()  # keys left eager because compiling would not fit in memory
        self.stored: Dict[tuple, bool] = {}  # keys with a package on disk (compile="auto" takes those at once)
        self.loaded: set = set()  # keys whose package was on disk already (their time in seen is a load's)
        self.weights: Optional[str] = None  # the weights' fingerprint, once a package is looked for
        self.estimate = 10.0 + 10.0 * weight_bytes(model) / 1e9  # seconds, fitted to measured compile times
        self.eager_up_to = eager_batches(model) if lazy else 0  # batch sizes "auto" never compiles
        self.reset()

    def key(self, batch: int, rows, cap: int = 0) -> tuple:
        return bucket(batch, max(self.model.max_batch_size, cap)), rows is not None

    def verifies_exactly(self) -> bool:
        """Whether a speculative Verify pass's rows are bitwise the one-token graph's: our kernels take every product
        and the graph's own arithmetic is fp32 (in bf16 Inductor's graphs of 1 and 4 rows round apart, measured in
        docs/performance-history.md, "With a compiled decode step")."""
        return self.outside and not self.cuda and self.model.norm.weight.dtype == torch.float32

    def spent_eager(self, batch: int, rows, seconds: float) -> None:
        """Record an eager decode step the lazy rule sent back to the model."""
        key = self.key(batch, rows)
        self.eager[key] = self.eager.get(key, 0.0) + seconds

    def ready(self, key: tuple) -> bool:
        """Whether this key runs compiled now (compiling it first if that is due)."""
        if key in self.seen:
            return True
        if self.fp32_gemm_eager and key[0] >= FP32_EAGER_MIN_BATCH:
            return False
        if key[0] <= self.eager_up_to and not self.on_disk(key):  # stored: a load of seconds, not minutes
            return False
        if key in self.refused or (self.lazy and self.eager.get(key, 0.0) < self.cost() and not self.on_disk(key)):
            return False
        if not memory_allows(self.model):
            self.refused.add(key)
            if parallel.is_main_process():
                print(f"Not compiling the decode step for batch size {key[0]}: a compiled graph keeps its own copy "
                      "of the weights and there is not enough free memory; that batch size stays eager")
            return False
        return True

    def cost(self) -> float:
        """Expected seconds to compile one more graph: the slowest compile measured so far, else the estimate."""
        compiled = [t for key, t in self.seen.items() if key not in self.loaded]
        return max(compiled) if compiled else self.estimate

    def on_disk(self, key: tuple) -> bool:
        """Whether a package for this key is stored, so that loading it costs seconds, not a compile."""
        if key not in self.stored:
            path = self.package_path(key)
            self.stored[key] = path is not None and step_store.stored(path)
        return self.stored[key]

    def package_path(self, key: tuple):
        if not step_store.enabled(self.model):
            return None
        if self.weights is None:
            self.weights = step_store.fingerprint(self.model)
        return step_store.package_path(self.weights, key[0], key[1], self.config)

    def reset(self) -> None:
        """Forget compiled graphs (for a model whose caches were reallocated); loaded packages stay (they take
        the caches as inputs)."""
        self._fn = None
        self.seen = {key: t for key, t in self.seen.items() if key in self.packages}

    @property
    def fn(self):
        """torch.compile's wrapper of the step, made when a step first compiles: making it imports Dynamo (2-9 s
        on a 2-core machine), which a process that never compiles (compile="auto" below its switch, a GGUF file's
        eager decode) should not pay at build."""
        if self._fn is None:
            # an MoE layer runs eagerly between graphs (llama/moe.py: a graph break each), every other step in one
            moe.eager_in_compiled_steps()
            self._fn = torch.compile(self.model.decode_step, dynamic=False, fullgraph=self.model.params.moe is None)
        return self._fn

    @torch.inference_mode()  # freezing folds the weights in only for inference graphs
    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, rows: Optional[torch.Tensor] = None, cap: int = 0):
        """Logits (B, 1, V), or None when this batch size should run eagerly for now (lazy rule, memory).

        A batch is padded up to a power of two (capped at max_batch_size, or cap if larger) so that a
        continuous-batching engine whose batch size keeps changing compiles a handful of graphs, not one per size.
        Padding rows repeat the last row (same cache row, token and position): they write the same keys and values
        to the same place, and their logits are dropped.

        A speculative Verify pass (llama/core/speculation/speculative.py) runs here too, with rows given and cap its most rows:
        a request's k+1 rows share its cache row at consecutive positions. The graph writes every row's key and
        value before any row attends, and each row attends under its own position's mask, so where our kernels take
        every product (self.outside) each row is bitwise the one-token graph's at that position (tested in
        tests/compilation/test_compiled_speculation.py).
        """
        B = tokens.shape[0]
        if not self.ready(self.key(B, rows, cap)):
            return None
        blocks = self.model.layers[0].attention.blocks
        if blocks is not None:
            blocks.direct()  # outside the runner: the pool's slot layout (llama/kernels/paged.py BlockTable)
        size = bucket(B, max(self.model.max_batch_size, cap))
        if size != B:
            if rows is None:
                rows = torch.arange(B, device=tokens.device)
            pad = size - B
            tokens = torch.cat([tokens, tokens[-1:].expand(pad, -1)])
            pos, rows = torch.cat([pos, pos[-1:].expand(pad)]), torch.cat([rows, rows[-1:].expand(pad)])
        return self.step(tokens, pos, rows)[:B]

    def step(self, tokens: torch.Tensor, pos: torch.Tensor, rows: Optional[torch.Tensor]):
        key = (tokens.shape[0], rows is not None)
        if key in self.packages:
            return self.packages[key](tokens, pos, rows)
        if key in self.seen:
            with inductor_config().patch(self.config):
                return self._own(self.fn(tokens, pos, rows))
        start = time.time()
        moe.eager_in_compiled_steps()  # before a package traces the step too
        if self.package_path(key) is not None:
            if parallel.is_main_process():
                print(f"Loading the compiled decode step for batch size {key[0]} (compiled by an earlier process)"
                      if self.on_disk(key) else
                      f"Compiling the decode step for batch size {key[0]} ({self.mode}); kept on disk for later "
                      "processes")
            package, loaded = step_store.get(self.model, self.weights, (tokens, pos, rows), self.config)
            if package is not None:
                if loaded:
                    self.loaded.add(key)
                self.packages[key], self.stored[key] = package, True
                out = package(tokens, pos, rows)
                self.seen[key] = time.time() - start
                return out
        elif parallel.is_main_process():
            print(f"Compiling the decode step for batch size {key[0]} ({self.mode}); done once per batch size")
        with inductor_config().patch(self.config):
            out = self._own(self.fn(tokens, pos, rows))
        self.seen[key] = time.time() - start
        return out

    def _own(self, logits: torch.Tensor) -> torch.Tensor:
        """A CUDA graph's output lives in memory its next replay overwrites: copy the (small) logits out."""
        return logits.clone() if self.cuda else logits


def bucket(batch: int, max_batch: int) -> int:
    """The smallest power of two >= batch, at most max_batch."""
    return min(1 << (batch - 1).bit_length(), max(max_batch, batch))


@torch.no_grad()
def own_storage(model) -> None:
    """Give every parameter that is a view into a larger storage its own copy.

    Inductor's max-autotune GEMM templates prepack frozen weights ignoring the storage offset, so a weight that
    is a slice of a shared storage (checkpoints that store all layers' wo in one tensor, as llama2.c conversions
    do) would be packed from the wrong bytes and give garbage.
    """
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.storage_offset() != 0 or p.untyped_storage().nbytes() != p.numel() * p.element_size():
                setattr(module, name, torch.nn.Parameter(p.clone(memory_format=torch.contiguous_format),
                                                         requires_grad=p.requires_grad))
    fused_decode.forget()  # the one-call eager step's kept arguments name the views


def auto_mode(model) -> str:
    """max-autotune for fp32 weights that our kernels do not take (Inductor's own GEMV template on frozen weights
    wins there), default otherwise (our kernels; oneDNN's prepacked GEMV for bf16 and int8); the measurements are
    in docs/performance.md."""
    if model.norm.weight.device.type != "cpu" or float_kernel_model(model):
        return "default"  # the fp32 GEMV template measured best is Inductor's CPU one
    fp32 = model.norm.weight.dtype == torch.float32
    return "max-autotune" if fp32 and not quantized(model) else "default"


def eager_batches(model) -> int:
    """Batch sizes up to which compile="auto" leaves decoding eager: on CPU, when every product, attention and
    RMSNorm of a decode step run in our kernels (llama/kernels/cpu.py), for models of EAGER_KERNEL_MIN_BYTES or
    more, or of GGUF blocks at any size (LinearMethod.eager_decode); 0 otherwise (PyTorch's kernels, other
    devices, smaller float models: the lazy rule decides)."""
    if (model.norm.weight.device.type != "cpu" or model.norm.weight.dtype not in (torch.float32, torch.bfloat16)
            or model.params.head_dim % 8 or not cpu.available()):
        return 0
    if not kernel_model(model):
        return 0  # a layer in PyTorch's kernels (oneDNN's int8, aten's int4 layout, int8 weight-only, a strided view)
    if weight_bytes(model) < EAGER_KERNEL_MIN_BYTES and not all(m.method.eager_decode for m in linear_layers(model)):
        return 0
    fp32 = not quantized(model) and model.norm.weight.dtype == torch.float32
    return FP32_KERNEL_MAX_ROWS if fp32 else EAGER_KERNEL_MAX_BATCH


def linear_weights(model) -> list:
    """Every linear layer's weight tensor: the float or int8 weight, or int8-dynamic's prepacked copy."""
    return [m.method.weight_tensor(m) for m in linear_layers(model)]


def weight_bytes(model) -> int:
    """Bytes of the linear layers' weights (what a compiled graph may copy)."""
    return sum(t.numel() * t.element_size() for t in linear_weights(model))


def memory_allows(model) -> bool:
    """Whether another compiled graph fits: freezing copies (and prepacks) fp32/bf16 weights into every graph.

    int8 weights are not copied, nor float weights in our kernels (they stay out of the graph). Reads MemAvailable
    (Linux); elsewhere it cannot tell and says yes, as it does under model parallel, where every rank must make the
    same choice.
    """
    if (model.norm.weight.device.type != "cpu" or not any(p.is_floating_point() for p in linear_weights(model))
            or kernel_model(model)):
        return True
    if parallel.model_parallel_size() > 1:
        return True
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return True
    return available > 1.2 * weight_bytes(model) + 2**30



def wants_auto(model) -> bool:
    """compile="auto" considers compiling: on CPU or CUDA, for models of AUTO_MIN_PARAMS or more, in a single
    process. Model-parallel ranks must switch to their graphs at the same step (eager and compiled
    steps issue different collectives), which a rule based on each rank's own timing cannot promise: there, pass
    compile=True."""
    params = sum(p.numel() for p in model.parameters())
    params += sum(b.numel() for name, b in model.named_buffers() if name.endswith(".packed"))  # int8-dynamic
    return (model.norm.weight.device.type in ("cpu", "cuda") and params >= AUTO_MIN_PARAMS
            and parallel.model_parallel_size() == 1)


def llama_cpp_arith(model) -> bool:
    return model.norm.ggml_arith


def compile_decode(model, mode: Union[bool, str, None] = True) -> Optional[CompiledDecode]:
    """The compiled one-token decode step the runner uses, or None for eager decoding.

    mode: True (compile each batch size on first use, Inductor mode chosen by dtype), "max-autotune" (Inductor's
    own GEMM templates, slowest to compile), "default" (freezing, library GEMMs), or "auto": on CPU, for models of
    AUTO_MIN_PARAMS or more, compile a batch size once eager decoding at it has cost as much as compiling would
    (CompiledDecode's lazy rule); otherwise stay eager. False or None: eager. A model in llama.cpp's arithmetic
    (llama/kernels/ggml_arith.py) decodes eagerly whatever the mode: its ops are not traced.
    """
    if mode is False or mode is None or (mode == "auto" and not wants_auto(model)) or llama_cpp_arith(model):
        return None
    return CompiledDecode(model, "auto" if mode in (True, "auto") else mode, lazy=mode == "auto")
