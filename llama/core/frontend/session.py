"""Multi-turn chat sessions that keep their KV cache between turns, so a turn prefills only its new tokens: each
turn's blocks stay in the pool as a Prefix (llama/core/frontend/prefix.py) that the next turn continues."""

from typing import Iterator, Optional

from llama.core.frontend.inputs import expand_params
from llama.core.frontend.prefix import Prefix


class ChatSession:
    """A conversation whose prompt each turn is the chat template of the whole dialog, so the answer is the one
    chat_completion gives for that dialog; the cache of the previous turn covers its common start."""

    def __init__(self, llama, system: Optional[str] = None):
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system must be a str, got {type(system).__name__}")
        self.llama = llama
        self.dialog = [{"role": "system", "content": system}] if system else []
        self.cache: Optional[Prefix] = None
        self.last_prefilled = 0  # tokens the last turn actually computed (its prompt minus the reused start)

    def close(self) -> None:
        """Give the conversation's KV blocks back to the pool (the next turn, if any, computes everything)."""
        if self.cache is not None:
            self.cache.close()

    def send(self, message: str, **params) -> str:
        """Add a user message and return the assistant's reply."""
        return "".join(self.stream(message, **params))

    def stream(self, message: str, **params) -> Iterator[str]:
        """Add a user message and yield the reply as text deltas; the turn is recorded once it completes."""
        if not isinstance(message, str):
            raise ValueError(f"message must be a str, got {type(message).__name__}")
        if params.get("echo"):
            raise ValueError("echo is not available in a chat session: the dialog so far is session.dialog")
        llama = self.llama
        dialog = self.dialog + [{"role": "user", "content": message}]
        tokens, refusal = llama.inputs.encode_dialog(dialog)
        options = expand_params(1, **params)
        if refusal is not None:
            return iter([refusal])
        if len(tokens) >= llama.max_seq_len:
            raise ValueError(
                f"the conversation would need {len(tokens)} prompt tokens, more than max_seq_len={llama.max_seq_len} "
                "allows: start a new session or build the generator with a larger max_seq_len"
            )
        # The template already holds the history; the cache only spares recomputing its common start.
        req = llama.inputs.requests([tokens], options, prefix=self.cache, chat=True)[0]
        return self._turn(dialog, req)

    def _turn(self, dialog, req) -> Iterator[str]:
        def keep_cache(req):  # the row's blocks still hold this turn: keep them before the cache is released
            self.last_prefilled = len(req.prompt) - req.reused
            tokens = req.cached
            if self.cache is not None:
                self.cache.close()
            self.cache = Prefix.from_slot(self.llama.cache, req.slot, tokens)

        yield from self.llama.stream_request(req, keep_cache)
        self.dialog = dialog + [{"role": "assistant", "content": req.stream.text}]
