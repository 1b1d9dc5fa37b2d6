"""One request: its prompt, parameters and text stream, its place in the decode core, and the handle its caller
holds (a future for its prediction and an iterator over its text deltas). The static batch, streams, chat
sessions and the engine all pass the same object around.
"""

import queue
import threading
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from llama.core.frontend.params import SamplingParams
from llama.core.frontend.textstream import TextStream

_END = object()  # end of a request's delta stream


@dataclass(eq=False)
class Request:
    """One sequence being generated: one sample of one prompt, in one cache slot while it runs.

    result() blocks for the prediction dict; iterating yields text deltas; cancel() frees its slot. Safe to use
    from any thread.
    """

    prompt: List[int]
    params: SamplingParams
    max_new: int
    stream: TextStream
    stop_tokens: Dict[int, str]
    sample: int = 0
    prefix: Optional[object] = None  # a Prefix whose cached positions this prompt continues
    twin: Optional["Request"] = None  # an earlier sample of the same prompt: its prompt cache is copied, not recomputed
    has_twins: bool = False  # later requests name this one as their twin
    successor: Optional["Request"] = None  # took over as its twins' source after this one left its slot
    chat: bool = False
    id: int = 0
    # what it produced
    generated: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    prompt_logprobs: List[float] = field(default_factory=list)
    top_logprobs: List[List[Tuple[int, float]]] = field(default_factory=list)  # with params.top_logprobs
    prompt_top_logprobs: List[List[Tuple[int, float]]] = field(default_factory=list)
    finish_reason: Optional[str] = None  # a stop token's reason ("eos", ...), "stop", "length", "cancelled", "error"
    error: Optional[BaseException] = None
    prediction: Optional[Dict] = None
    # where it is in the decode core (owned by the scheduler)
    slot: int = -1
    order: int = 0  # admission order: older requests get the prefill budget first
    prefilled: int = 0  # prompt positions whose keys/values are in the slot
    reused: int = 0  # of those, positions loaded from the prefix or the twin instead of computed
    feed: Optional[int] = None  # sampled token to feed at the next decode step
    fed: int = 0  # generated tokens whose keys/values are in the slot
    first_logits: Optional[object] = None  # next-token logits after the prompt, kept for twins that copy this one
    cancelled: bool = False
    matcher: Optional[object] = None  # the grammar's state (llama.sample.grammar.Matcher) when the request has one
    blocks: List[int] = field(default_factory=list)  # its KV pool blocks, position p in blocks[p // block_size]
    resumed: int = 0  # after a preemption: the generated tokens its prefill recomputes after the prompt
    cache_salt: str = ""  # prefix-cache isolation (the server's per-API-key salt); None: no prefix cache
    predicted: Optional[List[int]] = None  # params.prediction's tokens, a draft source (llama/core/speculation/speculative.py)
    drafted: int = 0  # drafted tokens verified for it, and of those accepted (OpenAI's prediction tokens)
    accepted: int = 0

    def __post_init__(self):
        self._deltas: "queue.Queue" = queue.Queue()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: List[Callable[["Request"], None]] = []
        self.wake: Callable[[], None] = lambda: None  # set by the engine that runs it: cancel() calls it

    def __repr__(self) -> str:
        return f"Request(id={self.id}, finish_reason={self.finish_reason!r})"

    # ------------------------------------------------------------------------------------------ decoding
    def advance(self, tok: int, logprob: Optional[float] = None, top: Optional[List[Tuple[int, float]]] = None) -> str:
        """Take one sampled token; return the text now safe to release. While unfinished, the next decode step
        feeds `tok` at position `next_pos`."""
        self.fed = len(self.generated)  # every token generated so far was fed before this one was sampled
        if tok in self.stop_tokens:
            self.finish_reason = self.stop_tokens[tok]
            return self.stream.finish()
        self.generated.append(tok)
        if logprob is not None and self.params.logprobs:
            self.logprobs.append(logprob)
            if top is not None and self.params.top_logprobs:
                self.top_logprobs.append(top)
        text = self.stream.add(tok)
        complete = False
        if self.matcher is not None:
            try:
                complete = self.matcher.consume(tok)
            except ValueError as e:
                self.fail(ValueError(f"request {self.id}: {e}"))
                return text
        if self.stream.stopped:
            self.finish_reason = "stop"
            keep = self.stream.tokens_before_stop()
            del self.generated[keep:], self.logprobs[keep:], self.top_logprobs[keep:]
            self.fed = min(self.fed, keep)
        elif complete:  # the grammar allows nothing more: its text is complete
            self.finish_reason = "stop"
        elif len(self.generated) >= self.max_new:
            self.finish_reason = "length"
        if self.finish_reason is None:
            self.feed = tok
            return text
        self.feed = None
        return text + self.stream.finish()

    @property
    def next_pos(self) -> int:
        """The position of the token fed next."""
        return len(self.prompt) + len(self.generated) - 1

    @property
    def context(self) -> List[int]:
        """The tokens its prefill covers: the prompt, and after a preemption the tokens it had fed back."""
        return self.prompt + self.generated[: self.resumed] if self.resumed else self.prompt

    @property
    def cached(self) -> List[int]:
        """The tokens whose keys/values are in the slot (once finished: the prompt and every token fed back)."""
        return self.prompt + self.generated[: self.fed]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fail(self, error: BaseException, reason: str = "error") -> None:
        self.finish_reason, self.error, self.feed = reason, error, None

    @property
    def tokens_generated(self) -> int:
        return len(self.generated)

    # ------------------------------------------------------------------------------------------ the caller's side
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> Dict:
        """The prediction dict (as text_completion / chat_completion entries); raises the request's error,
        or CancelledError if it was cancelled."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.prediction

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return self.error

    def __iter__(self):
        """Text deltas as they are generated; their concatenation is the final text."""
        while True:
            item = self._deltas.get()
            if item is _END:
                self._deltas.put(_END)  # a second iteration ends at once
                break
            yield item
        if self.error is not None and not isinstance(self.error, CancelledError):
            raise self.error

    def cancel(self) -> bool:
        """Stop the request and free its slot at the next step; False if it had already finished."""
        with self._lock:
            if self._done.is_set():
                return False
            self.cancelled = True
        self.wake()
        return True

    def add_done_callback(self, fn: Callable[["Request"], None]) -> None:
        """Call fn(request) once it finishes (from the engine's thread), or now if it already has."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def put(self, text: str) -> None:
        if text:
            self._deltas.put(text)

    def settle(self, prediction: Optional[Dict]) -> None:
        """Publish the outcome (prediction, or the error already set) and wake everyone waiting on it."""
        with self._lock:
            if self._done.is_set():
                return
            self.prediction = prediction
            self._deltas.put(_END)
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


class BatchError(ValueError):
    """Some requests of a batch failed (each error names its request and cause); the others' results are kept in
    `predictions` (None where a request failed), so nothing already computed is lost."""

    def __init__(self, errors: Dict[int, BaseException], predictions: List):
        self.errors, self.predictions = errors, predictions
        super().__init__("; ".join(f"result {i}: {e}" for i, e in errors.items()))




def __getattr__(name: str):
    """`Handle`, the name Engine.submit's result had before requests became one object: still there, with a
    DeprecationWarning, so code written for it keeps running."""
    if name == "Handle":
        import warnings

        warnings.warn("llama.Handle is deprecated: use llama.Request", DeprecationWarning, stacklevel=2)
        return Request
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
