"""A step's plan: the typed ops the scheduler emits and the runner executes, in order.

Ops are plain, small data (lists of ints, no tensors, no requests): model-parallel rank 0 broadcasts a step's ops
with torch.distributed.broadcast_object_list, and the pipelined engine pickles them to every other rank, which
replay them on their own runner. Cache rows are named as rows of the KVCache (a scheduler's base already added).

With the paged KV pool (llama/core/worker/kv_cache.py) the scheduler names blocks: SetBlocks gives rows their block
tables (admission, growth, preemption, a compaction move, a twin sharing its source's prompt blocks), CopyBlocks
copies a block on write. CopyRows (whole sequences) is what a scheduler without a pool emits.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

from llama.core.frontend.request import Request

Positions = Union[int, List[int]]


@dataclass(frozen=True)
class LoadPrefix:
    """Cache row `row` continues a prefix (Llama.prefill, a chat session's last turn; by its id) for `length`
    positions: it shares the prefix's full blocks (its table names them) and gets a copy of the partial last one."""

    prefix: int
    row: int
    length: int


@dataclass(frozen=True)
class CopyRows:
    """Copy the first `length` positions of each cache row src[i] into row dst[i]: compaction moves a request to a
    lower row, a twin gets its source's prompt."""

    src: List[int]
    dst: List[int]
    length: int


@dataclass(frozen=True)
class Prefill:
    """One padded forward pass over prompt chunks: tokens[i] (right-padded to one width) at positions from start
    (one for all rows, or one per row) into cache rows[i]. last: the index of each row's last real token, whose
    logits alone come back; None when some request needs every position's logits (it echoes prompt scores).
    kv_len: the cache positions the pass attends over."""

    tokens: List[List[int]]
    start: Positions
    rows: List[int]
    last: Optional[List[int]]
    kv_len: int


@dataclass(frozen=True)
class Decode:
    """One token for each slot 0..len(tokens)-1 of a scheduler whose slot 0 is cache row `base`: tokens[s] at
    position pos[s]. `active` lists the slots whose logits are sampled; the others (dummy tokens at positions no
    one has filled yet) are there so the pass reads slots 0..B-1 in place."""

    tokens: List[int]
    pos: List[int]
    active: List[int]
    base: int = 0


@dataclass(frozen=True)
class Verify:
    """Speculative decoding's pass (llama/core/speculation/speculative.py): one token per row, tokens[i] at position pos[i] in
    cache row rows[i]. A request's rows are consecutive and share its cache row: its last token and its draft at
    positions p, p+1, ...; every row's key and value is written before any row attends, and each row attends only
    up to its own position, so row i's logits are those a one-token step would give at that position."""

    tokens: List[int]
    pos: List[int]
    rows: List[int]


@dataclass(frozen=True)
class SetBlocks:
    """Set the block tables of cache rows: rows[i] reads and writes blocks[i] (then the scratch block)."""

    rows: List[int]
    blocks: List[List[int]]


@dataclass(frozen=True)
class CopyBlocks:
    """Copy whole pool blocks src[i] into dst[i] (a twin's own copy of its source's partial last prompt block)."""

    src: List[int]
    dst: List[int]


Op = Union[SetBlocks, CopyBlocks, LoadPrefix, CopyRows, Prefill, Decode, Verify]
FORWARD = (Prefill, Decode, Verify)  # the ops that run the model


@dataclass
class Plan:
    """One step: `ops` in order (what model-parallel followers replay), and which requests they serve (on the
    planning rank only: requests never travel)."""

    ops: List[Op] = field(default_factory=list)
    prefill: List[Tuple[Request, int, int]] = field(default_factory=list)  # (request, start, length), in op order
    twins: List[Tuple[Request, Request]] = field(default_factory=list)  # (request, the source it copies)
    decoding: List[Request] = field(default_factory=list)  # requests that get a token from the Decode op
    verifying: List[Tuple[Request, List[int]]] = field(default_factory=list)  # (request, its draft), Verify op order
    # what verifying found, per request: (request, its draft, how many of the draft's tokens it accepted); the
    # decode core tells the drafting speculator after the step
    accepted: List[Tuple[Request, List[int], int]] = field(default_factory=list)
