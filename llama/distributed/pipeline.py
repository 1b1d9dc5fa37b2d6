"""Pipeline parallel: the layers split into P contiguous stages, each stage tensor-parallel over T ranks.

Layout (parallel.init_distributed): world = T x P ranks, global rank = stage * T + tensor-parallel rank, so a
stage's T ranks are consecutive (one node under `torchrun --nproc_per_node T`) and its all-reduces stay inside the
node; only activations cross between stages. Stage 0 holds the embedding, the last stage the final norm and the
output projection; every stage holds its own layers and the KV cache of those layers only (llama/core/worker/kv_cache.py allocates
a cache for the layers the model has).

One forward pass (the decode core's, unchanged): every rank of the job runs the same op with the same arguments.
Stage s receives the hidden states from stage s-1 (point-to-point), runs its layers, sends them to stage s+1;
the last stage computes the logits. Where they go next (`logits_to`, an argument of each pass that the runner's
PipelineExecution picks):

- "last" (the decode core's sampling passes in calls on Llama, which every rank runs): they stay on the last
  stage, which samples and broadcasts only the tokens (with their log-probabilities, failures and, when unseeded
  sampling drew from it, its RNG state) over its pipeline group (`share_samples`, through the execution). Every
  rank advances its requests with the same tokens, so the schedulers stay in lockstep, as under tensor parallel.
- "first" (the engine's sampling passes: its rank 0, on stage 0, samples every request): the last stage sends the
  logits to the first stage only; the stages in between return a placeholder (their engine ranks discard it).
- "all" (scoring, prefixes, prompt log-probabilities): the last stage broadcasts the logits over its pipeline
  group, so every rank returns the same logits as a single process.

With T > 1 each tensor-parallel rank sends only its 1/T slice of the hidden states (or logits) to its peer, and
the receiving stage all-gathers the slices inside its node, so the bytes that cross between stages do not grow
with T.

Long prefill passes are cut into sequence chunks (micro_batches) sent with isend, so stage s works on chunk j+1
while stage s+1 works on chunk j. Decode steps overlap through the engine (llama/distributed/pipeline_engine.py): with
`deferred` passes, the first stage's sampling passes return a Pending instead of waiting for the logits, and sends
are kept in an Outbox instead of being waited for, so the first stage can run another group's step meanwhile.

The decode core knows none of this: the facade builds its Runner with a PipelineExecution, the strategy that picks
each pass's logits_to and deferred, shares the samples, waits for Pending logits and gives the engine its
overlapping groups.

Why not torch.distributed.pipelining: it schedules training micro-batches through a stage's forward (and
backward) with its own shape inference, and owns the loop that drives them. Inference here needs a persistent
per-stage KV cache written at per-row positions, ragged shapes that change every step (prefill chunks, a decode
batch that grows and shrinks), and the one decode core and scheduler to stay the only loop. Point-to-point
sends inside the model's forward give exactly that, with shapes every rank already knows from the op.
"""

import pickle
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fs_init
from torch import nn

from llama.core.worker.runner import Execution
from llama.distributed import parallel
from llama.distributed.pipeline_engine import Pipelined, follow
from llama.formats import meta_checkpoint
from llama.kernels import ggml_products
from llama.model import ColumnLinear, Embedding, ModelArgs, RMSNorm, Transformer, TransformerBlock, check_model_parallel


@dataclass(frozen=True)
class Stage:
    """One pipeline stage as seen from one rank: its index, the global layer ids it runs, and the global ranks of
    its pipeline group (the same tensor-parallel rank in every stage, first stage first)."""

    index: int
    count: int
    layers: range
    ranks: Tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def split_layers(n_layers: int, stages: int) -> List[range]:
    """P contiguous, balanced ranges of layer ids: sizes differ by at most one, the larger ones first (the last
    stage also runs the final norm and the output projection)."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {stages!r}")
    if n_layers < stages:
        raise ValueError(f"pipeline_parallel_size {stages} exceeds n_layers ({n_layers}): every stage needs at least "
                         f"one layer, so use at most {n_layers} stages")
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (s < extra)
        out.append(range(start, start + size))
        start += size
    return out


MICRO_TOKENS = 64  # shortest sequence chunk a forward pass is cut into (below it, splitting costs more than it saves)


def micro_batches(length: int, stages: int) -> List[Tuple[int, int]]:
    """[start, end) chunks of a pass's `length` positions: one for decode steps and short prefills, up to 2 x
    stages chunks of at least MICRO_TOKENS for long ones (the pipeline then runs at about M / (M + P - 1))."""
    count = max(1, min(2 * stages, length // MICRO_TOKENS))
    bounds = [length * k // count for k in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def check_layout(args: ModelArgs, model_parallel_size: int, pipeline_parallel_size: int) -> None:
    """ValueError naming the input and its limit unless (T, P) fits the model: layers >= P, and T divides the head
    counts, dim, FFN width and vocabulary."""
    split_layers(args.n_layers, pipeline_parallel_size)
    check_model_parallel(args, model_parallel_size)


def current_stage(n_layers: int) -> Stage:
    """This rank's stage, from the process groups parallel.init_distributed made."""
    count, index = parallel.pipeline_parallel_size(), parallel.pipeline_parallel_rank()
    return Stage(index, count, split_layers(n_layers, count)[index], tuple(parallel.pipeline_parallel_ranks()))


def local_name(name: str, stage: Stage) -> Optional[str]:
    """The name of checkpoint tensor `name` in this stage's model (layer ids renumbered from 0), or None when the
    stage does not hold it. Every stage keeps the final norm's few bytes: it is the cache's dtype/device reference."""
    if name.startswith("layers."):
        i, rest = name[len("layers."):].split(".", 1)
        return f"layers.{int(i) - stage.layers.start}.{rest}" if int(i) in stage.layers else None
    if name == "tok_embeddings.weight":
        return name if stage.first else None
    if name == "output.weight":
        return name if stage.last else None
    return name


class Pending:
    """Logits still on their way from the last stage: result() waits for them (and applies the indexing done on
    the Pending meanwhile). What the first stage's sampling passes return while the engine overlaps steps."""

    def __init__(self, wait: Callable[[], torch.Tensor]):
        self._wait, self._value = wait, None

    def __getitem__(self, index) -> "Pending":
        return Pending(lambda: self.result()[index])

    def result(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._wait()
        return self._value


class Outbox:
    """Sends in flight, each kept (with the tensor it reads) under the ticket of the engine step that made it until
    settle() waits for it. Waiting at once would hold a stage until the receiver, maybe busy with an earlier step,
    posts its receive; once a step's logits are back on the first stage, every send of that step has arrived."""

    def __init__(self):
        self.ticket = 0
        self._sends: List[Tuple[int, dist.Work, torch.Tensor]] = []

    def keep(self, work: dist.Work, tensor: torch.Tensor) -> None:
        self._sends.append((self.ticket, work, tensor))

    def settle(self, upto: Optional[int] = None) -> None:
        """Wait for the sends of tickets <= upto (all when None)."""
        keep = []
        for ticket, work, tensor in self._sends:
            if upto is None or ticket <= upto:
                work.wait()
            else:
                keep.append((ticket, work, tensor))
        self._sends = keep


class PipelineTransformer(Transformer):
    """The layers of one stage (and the embedding on the first, the output on the last) with a forward pass that
    exchanges hidden states and logits with the other stages. Same call signature and result as Transformer."""

    def __init__(self, params: ModelArgs, stage: Stage):
        nn.Module.__init__(self)
        if params.vocab_size < 1:
            raise ValueError(f"vocab_size must be set (got {params.vocab_size}); take it from the tokenizer")
        self.tp = fs_init.get_model_parallel_world_size()
        check_layout(params, self.tp, stage.count)
        self.params, self.stage = params, stage
        self.vocab_size, self.n_layers = params.vocab_size, params.n_layers
        self.tok_embeddings = Embedding(params.vocab_size, params.dim) if stage.first else None
        self.layers = nn.ModuleList(TransformerBlock(i, params) for i in stage.layers)
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = ColumnLinear(params.dim, params.vocab_size, gather_output=True) if stage.last else None
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        # What this rank sent to other stages and how its time went: compute (own layers, embedding, output)
        # versus waiting for another stage. Read by benchmarks/bench_pipeline.py. Host-side clocks: on CUDA they
        # time kernel launches, not kernels, unless CUDA_LAUNCH_BLOCKING=1.
        self.traffic: Dict[str, float] = {"sent_bytes": 0, "messages": 0, "compute_s": 0.0, "wait_s": 0.0}
        self.outbox = Outbox()  # sends of deferred passes, until their engine step is known to be done

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos=0, rows: Optional[torch.Tensor] = None,
                logit_index: Optional[torch.Tensor] = None, kv_len: Optional[int] = None, logits_to: str = "all",
                deferred: bool = False) -> torch.Tensor:
        """Transformer.forward, plus where the logits go (logits_to: "all", "last" or "first", see the module
        docstring) and deferred (the pipelined engine: sampling logits come back as a Pending, sends go to the
        outbox)."""
        if logits_to not in ("all", "last", "first"):
            raise ValueError(f"logits_to must be 'all', 'last' or 'first', got {logits_to!r}")
        # llama.cpp's arithmetic: its batched products take each row's tokens (llama/kernels/ggml_products.py)
        with ggml_products.sequence_tokens(ggml_products.row_tokens(logit_index) if self.norm.ggml_arith else None):
            return self._stage_pass(tokens, start_pos, rows, logit_index, kv_len, logits_to, deferred)

    def _stage_pass(self, tokens: torch.Tensor, start_pos, rows, logit_index, kv_len, logits_to: str,
                    deferred: bool) -> torch.Tensor:
        """forward() past its checks: this stage's share of the pass, chunk by chunk."""
        B, T = tokens.shape
        cos, sin, start, positions, rows, kv_len, mask = self.layer_inputs(tokens, start_pos, rows, kv_len)
        pending, outputs = [], []
        for a, b in micro_batches(T, self.stage.count):
            # One sequence chunk: its rotary rows, positions, causal-mask rows, and the keys written so far
            # (chunks before it, in this pass or earlier ones). Stage s works on chunk j+1 while stage s+1 works on
            # chunk j: a long prefill keeps the stages busy at once.
            seen = kv_len - (T - b)
            args = (cos[:, a:b], sin[:, a:b], None if start is None else start + a, positions[:, a:b], rows, seen,
                    None if mask is None else mask[:, :, a:b, :seen])
            if self.stage.first:
                tic = time.perf_counter()
                h = self.embed(tokens[:, a:b])
            else:
                h = self._receive((B, b - a, self.params.dim), self.norm.weight.dtype,
                                  self.stage.ranks[self.stage.index - 1])
                tic = time.perf_counter()
            h = self.run_layers(h, *args)
            self.traffic["compute_s"] += time.perf_counter() - tic
            if self.stage.last:
                outputs.append(h)
            else:
                pending.append(self._send(h, self.stage.ranks[self.stage.index + 1]))
        tic = time.perf_counter()
        for work, part in pending:  # (the sent tensor is kept alive until its send completes)
            if deferred:
                self.outbox.keep(work, part)
            else:
                work.wait()
        self.traffic["wait_s"] += time.perf_counter() - tic
        logits = None
        if self.stage.last:
            tic = time.perf_counter()
            logits = self.logits(outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1), logit_index)
            self.traffic["compute_s"] += time.perf_counter() - tic
        shape = (B, 1 if logit_index is not None else T, self.vocab_size)
        placeholder = torch.zeros((), device=tokens.device).expand(shape)  # what ranks that do not sample get
        if logits_to == "last":  # the last stage samples and shares the tokens
            return logits if self.stage.last else placeholder
        if logits_to == "first":  # the engine: only its leader, on stage 0, samples
            if not (self.stage.first or self.stage.last):
                return placeholder
            return self._logits_to_first(logits, shape, deferred)
        return self._share_logits(logits, shape, tokens.device)

    def decode_step(self, tokens, pos, rows=None):
        raise RuntimeError("pipeline stages decode eagerly: the compiled decode step is not available with "
                           "pipeline_parallel_size > 1")

    # ------------------------------------------------------------------------------------------ communication
    def _slice(self, x: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's 1/T of x's last dimension: what it sends to its peer in another stage."""
        if self.tp == 1:
            return x.contiguous()
        return x.chunk(self.tp, dim=-1)[fs_init.get_model_parallel_rank()].contiguous()

    def _gather(self, part: torch.Tensor) -> torch.Tensor:
        return part if self.tp == 1 else parallel.gather_last_dim(part)

    def _send(self, h: torch.Tensor, dst: int) -> Tuple[dist.Work, torch.Tensor]:
        """Start sending h (this rank's slice of it) to global rank dst: (the work to wait on, the tensor sent)."""
        part = self._slice(h)
        self.traffic["sent_bytes"] += part.numel() * part.element_size()
        self.traffic["messages"] += 1
        return dist.isend(part, dst), part

    def _receive(self, shape, dtype, src: int) -> torch.Tensor:
        part = torch.empty(*shape[:-1], shape[-1] // self.tp, dtype=dtype, device=self.norm.weight.device)
        tic = time.perf_counter()
        dist.recv(part, src)
        h = self._gather(part)
        self.traffic["wait_s"] += time.perf_counter() - tic
        return h

    def _logits_to_first(self, logits: Optional[torch.Tensor], shape, deferred: bool) -> torch.Tensor:
        """The last stage's logits on the first stage only: each last-stage rank sends its vocabulary slice to its
        first-stage peer, which all-gathers them inside its node."""
        if self.stage.last:
            tic = time.perf_counter()
            work, part = self._send(logits, self.stage.ranks[0])
            if deferred:
                self.outbox.keep(work, part)
            else:
                work.wait()
            self.traffic["wait_s"] += time.perf_counter() - tic
            return logits
        if not deferred:
            return self._receive(shape, torch.float32, self.stage.ranks[-1])
        part = torch.empty(*shape[:-1], shape[-1] // self.tp, dtype=torch.float32, device=self.norm.weight.device)
        work = dist.irecv(part, self.stage.ranks[-1])

        @torch.inference_mode()  # (called later, from outside the forward pass)
        def wait() -> torch.Tensor:
            tic = time.perf_counter()
            work.wait()
            out = self._gather(part)
            self.traffic["wait_s"] += time.perf_counter() - tic
            return out
        return Pending(wait)

    def _share_logits(self, logits: Optional[torch.Tensor], shape, device) -> torch.Tensor:
        """The last stage's logits on every rank: each last-stage rank broadcasts its vocabulary slice over its
        pipeline group, and the other stages all-gather the slices inside their tensor-parallel group."""
        if self.stage.count == 1:
            return logits
        if self.stage.last:
            part = self._slice(logits)
        else:
            part = torch.empty(*shape[:-1], shape[-1] // self.tp, dtype=torch.float32, device=device)
        tic = time.perf_counter()
        dist.broadcast(part, self.stage.ranks[-1], group=fs_init.get_pipeline_parallel_group())
        if self.stage.last:
            self.traffic["sent_bytes"] += part.numel() * part.element_size() * (self.stage.count - 1)
            self.traffic["messages"] += self.stage.count - 1
            self.traffic["wait_s"] += time.perf_counter() - tic
            return logits
        out = self._gather(part)
        self.traffic["wait_s"] += time.perf_counter() - tic
        return out


    def share_samples(self, draw: Callable[[], tuple]) -> tuple:
        """draw() on the last stage (its tokens, log-probabilities, failures...), broadcast over the pipeline group
        as one small object; every rank returns the last stage's result. With unseeded sampling the last stage's
        RNG advanced alone: its new state travels along, so every rank's RNG stays the single process's."""
        device = self.norm.weight.device
        if self.stage.last:
            before = _rng_state(device)
            result = draw()
            after = _rng_state(device)
            obj = [(result, None if torch.equal(before, after) else after)]  # most steps leave the RNG alone
        else:
            obj = [None]
        tic = time.perf_counter()
        dist.broadcast_object_list(obj, src=self.stage.ranks[-1], group=fs_init.get_pipeline_parallel_group())
        self.traffic["wait_s"] += time.perf_counter() - tic
        result, rng = obj[0]
        if self.stage.last:
            self.traffic["sent_bytes"] += len(pickle.dumps(obj[0])) * (self.stage.count - 1)
            self.traffic["messages"] += self.stage.count - 1
        elif rng is not None:
            _set_rng_state(device, rng)
        return result


def resolve(outs: List) -> List:
    """Ops' outputs with every deferred one (Pending logits) waited for, in order."""
    return [o.result() if isinstance(o, Pending) else o for o in outs]


class PipelineExecution(Execution):
    """How the runner's passes run on pipeline stages. Calls on Llama (every rank runs them): the last stage samples
    and shares the tokens. Under the engine (leader_samples), its rank 0 on the first stage samples: sampling
    passes send their logits there, deferred while steps overlap."""

    def __init__(self, model: PipelineTransformer):
        super().__init__(lockstep=(None, 0))  # the engine: every rank of the job, led by global rank 0
        self.model, self.stage, self.outbox = model, model.stage, model.outbox
        self.leader, self.deferred = False, False

    def route(self, sampling: bool) -> Dict[str, object]:
        logits_to = ("first" if self.leader else "last") if sampling else "all"
        return {"logits_to": logits_to, "deferred": self.deferred}

    def share(self, draw: Callable[[], tuple]) -> tuple:
        return draw() if self.leader else self.model.share_samples(draw)

    def resolve(self, outs: List) -> List:
        return resolve(outs)

    @contextmanager
    def leader_samples(self, deferred: bool = False) -> Iterator[None]:
        saved, self.leader, self.deferred = (self.leader, self.deferred), True, deferred
        try:
            yield
        finally:
            self.leader, self.deferred = saved

    def overlap(self, core, prefill_chunk: int) -> Optional[Pipelined]:
        return Pipelined(core, prefill_chunk, self.stage.count, self.outbox) if self.stage.count > 1 else None

    def follow(self, runner, depth: int) -> dict:
        return follow(runner, self, depth)


def _rng_state(device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


# ---------------------------------------------------------------------------------------------------------- loading
def load_stage(ckpt_dir, args: ModelArgs, stage: Stage, rank: int, world_size: int) -> PipelineTransformer:
    """This rank's stage model (on the meta device, its tensors assigned): only the stage's layers (plus the
    embedding on the first stage, the output on the last) and only tensor-parallel slice `rank` of `world_size`,
    from a Meta checkpoint of any shard count. Tensors of other stages are never read: their pages stay on disk."""
    check_layout(meta_checkpoint.with_vocab(args, world_size), world_size, stage.count)  # before any file is read
    sset = meta_checkpoint.open_shards(ckpt_dir, args)
    check_model_parallel(sset.args, world_size)  # vocab_size may only be known from the weights
    state = {}
    for name in sset.names:
        local = local_name(name, stage)
        if local is not None:
            state[local] = sset.slice(name, rank, world_size)
    with torch.device("meta"):
        model = PipelineTransformer(args, stage)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint in {ckpt_dir} does not match its params.json: {e}") from None
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (tied tensors counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
