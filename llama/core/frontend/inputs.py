"""Turning what callers pass (prompts, token ids, dialogs, keyword options) into Requests, and finished Requests
into the reference's prediction dicts. Every entry point (Llama's methods, chat sessions, the engine) builds its
requests here, so validation, messages and limits are the same everywhere.
"""

import itertools
from typing import Dict, List, Optional, Sequence, Tuple

from llama.config.options import positive_int
from llama.core.frontend.params import SamplingParams, names, per_prompt
from llama.core.frontend.prefix import Prefix
from llama.core.frontend.request import Request
from llama.core.frontend.textstream import TextStream
from llama.tokenizers.text import check_text


def count(values, name: str) -> int:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(values).__name__}")
    return len(values)


def string_list(name: str, values) -> List[str]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{name} must be a list of strings")
    return list(values)


def expand_params(n_prompts: int, **options) -> List[SamplingParams]:
    """One SamplingParams per prompt from keyword options given once or once per prompt."""
    unknown = set(options) - set(names())
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    expanded = {k: per_prompt(k, v, n_prompts) for k, v in options.items()}
    return [SamplingParams(**{k: v[i] for k, v in expanded.items()}) for i in range(n_prompts)]


class RequestBuilder:
    """Validates inputs against one generator's tokenizer, chat format and cache size, and builds Requests."""

    def __init__(self, tokenizer, formatter, max_seq_len: int, vocab_size: int):
        self.tokenizer, self.formatter = tokenizer, formatter
        self.max_seq_len, self.vocab_size = max_seq_len, vocab_size
        self._ids = itertools.count()

    # ----------------------------------------------------------------------------------------- prompts
    def check_tokens(self, name: str, tokens) -> List[int]:
        if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ValueError(f"{name} must be a list of token ids (ints)")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return list(tokens)

    def encode_text(self, text: str, prefix: Optional[Prefix] = None) -> List[int]:
        """A text prompt's tokens; with a prefix (from Llama.prefill) they continue the prefix's tokens."""
        check_prefix(prefix)
        tokens = self.tokenizer.encode(check_text("prompt", text), bos=prefix is None, eos=False)
        return tokens if prefix is None else prefix.tokens + tokens

    def encode_dialog(self, dialog, index: int = 0) -> Tuple[Optional[List[int]], Optional[str]]:
        """(prompt tokens, None), or (None, the format's refusal text) for a dialog it will not run."""
        self.formatter.validate(dialog, index)
        refusal = self.formatter.refusal(dialog)
        if refusal is not None:
            return None, refusal
        return self.formatter.encode_dialog_prompt(dialog), None

    def prompt_tokens(self, prompt, prefix: Optional[Prefix] = None) -> Tuple[Optional[List[int]], Optional[str], bool]:
        """One prompt of any kind: a str, token ids or a dialog. Returns (tokens, refusal, chat)."""
        chat = isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt)
        if chat:
            if prefix is not None:
                raise ValueError("prefix applies to text or token prompts, not dialogs: use Llama.chat_session()")
            return (*self.encode_dialog(prompt), True)
        if isinstance(prompt, str):
            return self.encode_text(prompt, prefix), None, False
        if isinstance(prompt, (list, tuple)):
            check_prefix(prefix)
            tokens = self.check_tokens("prompt", prompt)
            return (tokens if prefix is None else prefix.tokens + tokens), None, False
        raise ValueError(f"expected a str, a list of token ids or a dialog, got {type(prompt).__name__}")

    # ----------------------------------------------------------------------------------------- requests
    def requests(self, prompts: List[List[int]], params: List[SamplingParams], n: int = 1,
                 prefix: Optional[Prefix] = None, index: Optional[Sequence[int]] = None,
                 chat: bool = False) -> List[Request]:
        """Validate every prompt before any work starts; one Request per (prompt, sample), prompt-major.

        Requests with the same prompt (the n samples of one, or repeats) name the first as their twin: the decode
        core prefills it once and copies its cache to the others.
        """
        positive_int("n", n)
        check_prefix(prefix)
        checked = []
        for k, toks in enumerate(prompts):
            name = f"prompt {index[k] if index is not None else k}"
            toks = self.check_tokens(name, toks)
            if not toks:
                raise ValueError(f"{name} is empty: it needs at least one token")
            if len(toks) >= self.max_seq_len:
                raise ValueError(f"{name} has {len(toks)} tokens; it must be shorter than max_seq_len="
                                 f"{self.max_seq_len} (shorten it or build the generator with a larger max_seq_len)")
            if prefix is not None and params[k].scores_prompt:
                prefix.prompt_logprobs(toks, prefix.reusable(toks))  # raises now if the scores are unknowable
                if params[k].top_logprobs and prefix.reusable(toks) > 0:
                    raise ValueError(f"{name}: echo with top_logprobs is unavailable when continuing a prefix (a "
                                     "prefix keeps its tokens' log-probabilities, not their alternatives)")
            checked.append(toks)
        stops = dict(self.tokenizer.stop_tokens)
        if chat:
            stops.update(self.formatter.stop_tokens)
        out, first = [], {}
        for toks, p in zip(checked, params):
            predicted = self.predicted(p)
            room = self.max_seq_len - len(toks)
            max_new = min(p.max_gen_len, room) if p.max_gen_len is not None else room
            for j in range(n):
                stream = TextStream(self.tokenizer, context=toks, stop=p.stop,
                                    strip_space=chat and self.formatter.strip_reply_space)
                r = Request(prompt=toks, params=p, max_new=max_new, stream=stream, stop_tokens=stops, sample=j,
                            prefix=prefix, chat=chat, id=next(self._ids), predicted=predicted)
                if p.grammar is not None:
                    r.matcher = p.grammar.matcher(self.tokenizer, stops)
                source = first.setdefault(tuple(toks), r)
                if source is not r:
                    r.twin, source.has_twins = source, True
                out.append(r)
        return out

    def predicted(self, p: SamplingParams) -> Optional[List[int]]:
        """A prediction's tokens (no longer than a sequence can be: more could never be drafted from)."""
        if p.prediction is None:
            return None
        tokens = self.tokenizer.encode(p.prediction, bos=False, eos=False)
        if len(tokens) > self.max_seq_len:
            raise ValueError(f"prediction has {len(tokens)} tokens; it must have at most max_seq_len="
                             f"{self.max_seq_len}")
        return tokens

    def samples(self, prompt, options: Dict, prefix: Optional[Prefix] = None, n: int = 1) -> List[Request]:
        """The engine's n requests for one prompt of any kind; a refused dialog's come back already settled."""
        positive_int("n", n)
        tokens, refusal, chat = self.prompt_tokens(prompt, prefix)
        params = expand_params(1, **options)
        if refusal is not None:
            return [self.refused(refusal, params[0]) for _ in range(n)]
        return self.requests([tokens], params, n=n, prefix=prefix, chat=chat)

    def failed(self, error: BaseException) -> Request:
        """A request that could not be built (bad prompt or parameters): settled at once with its error."""
        r = Request(prompt=[], params=SamplingParams(), max_new=0, stream=TextStream(self.tokenizer), stop_tokens={},
                    id=next(self._ids))
        r.fail(error)
        r.settle(None)
        return r

    def refused(self, text: str, params: SamplingParams) -> Request:
        """A dialog the chat format refuses: the answer is its error text, as in the reference."""
        r = Request(prompt=[], params=params, max_new=0, stream=TextStream(self.tokenizer), stop_tokens={},
                    chat=True, id=next(self._ids), finish_reason="error")
        r.put(text)
        r.settle(refusal_prediction(text, params.logprobs, params.top_logprobs))
        return r

    # ----------------------------------------------------------------------------------------- results
    def prediction(self, r: Request) -> Dict:
        """The reference's dict: generation (a message for chat), plus tokens and logprobs when asked."""
        text = r.stream.text
        if r.params.echo:
            text = self.tokenizer.decode(r.prompt) + text
        pred: Dict = {"generation": {"role": "assistant", "content": text} if r.chat else text}
        if r.params.logprobs:
            toks = (r.prompt if r.params.echo else []) + r.generated
            pred["tokens"] = [self.tokenizer.decode([t]) for t in toks]
            pred["logprobs"] = ([0.0] + r.prompt_logprobs if r.params.echo else []) + r.logprobs
            if r.params.top_logprobs:  # the first echoed prompt token has no context, so no alternatives
                tops = ([[]] + r.prompt_top_logprobs if r.params.echo else []) + r.top_logprobs
                pred["top_logprobs"] = [[{"token": self.tokenizer.decode([t]), "id": t, "logprob": lp} for t, lp in top]
                                        for top in tops]
        return pred

    def settle(self, r: Request) -> None:
        """Publish a finished request's outcome to whoever holds it."""
        r.settle(self.prediction(r) if r.error is None else None)


def refusal_prediction(text: str, logprobs: bool, top_logprobs: int = 0) -> Dict:
    scores = {"tokens": [], "logprobs": [], **({"top_logprobs": []} if top_logprobs else {})} if logprobs else {}
    return {"generation": {"role": "assistant", "content": text}, **scores}


def check_prefix(prefix) -> None:
    if prefix is not None and not isinstance(prefix, Prefix):
        raise ValueError(f"prefix must come from Llama.prefill(), got {type(prefix).__name__}")
