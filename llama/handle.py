"""The handle of a request submitted to the engine: a future for its prediction and a stream of its text."""

import queue
import threading
from concurrent.futures import CancelledError
from typing import Callable, Dict, List, Optional

_END = object()  # end of a handle's delta stream


class Handle:
    """One submitted request. result() blocks for its prediction; iterating yields its text deltas; cancel()
    frees its slot. Safe to use from any thread."""

    def __init__(self, engine, request_id: int, chat: bool):
        self.id = request_id
        self.chat = chat
        self.finish_reason: Optional[str] = None  # "eos", "stop", "length", "cancelled" or "error"
        self.tokens_generated = 0
        self._engine = engine
        self._deltas: "queue.Queue" = queue.Queue()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: List[Callable[["Handle"], None]] = []
        self._cancel = False
        self._prediction: Optional[Dict] = None
        self._error: Optional[BaseException] = None

    def __repr__(self) -> str:
        return f"Handle(id={self.id}, finish_reason={self.finish_reason!r})"

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> Dict:
        """The prediction dict (as text_completion / chat_completion entries); raises the request's error,
        or CancelledError if it was cancelled."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._prediction

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return self._error

    def __iter__(self):
        """Text deltas as they are generated; their concatenation is the final text."""
        while True:
            item = self._deltas.get()
            if item is _END:
                self._deltas.put(_END)  # a second iteration ends at once
                break
            yield item
        if self._error is not None and not isinstance(self._error, CancelledError):
            raise self._error

    def cancel(self) -> bool:
        """Stop the request and free its slot at the next step; False if it had already finished."""
        with self._lock:
            if self._done.is_set():
                return False
            self._cancel = True
        self._engine._wake()
        return True

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call fn(handle) once the request finishes (from the engine's thread), or now if it already has."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _put(self, text: str) -> None:
        self._deltas.put(text)

    def _settle(self, prediction: Optional[Dict], error: Optional[BaseException], finish_reason: str) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._prediction, self._error, self.finish_reason = prediction, error, finish_reason
            self._deltas.put(_END)
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
