"""Llama: build a generator from a checkpoint and run text/chat completion, streaming and scoring.

The public surface is Meta's reference (Llama.build, generate, text_completion, chat_completion) with its return
shapes; everything runs through one decode loop (`_run`) over `Row`s, each with its own prompt, parameters,
cache slot and position, so batching never changes a request's text.
"""

import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, TypedDict, Union

import torch

from . import checkpoint, parallel
from . import compile as compilation
from . import quantize as quantization
from .model import ModelArgs, Transformer
from .params import SamplingParams, per_prompt
from .prefix import ChatSession, Prefix
from .sampling import RowSampler, token_logprobs
from .sequence import Row
from .textstream import TextStream
from . import loader
from .chat import UNSAFE_ERROR, ChatFormat, Dialog, Message, has_special_tags, validate_dialog
from .tokenizer import Tokenizer


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


class ChatPrediction(TypedDict, total=False):
    generation: Message
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class Llama:
    @staticmethod
    def build(
        ckpt_dir: str,
        tokenizer_path: str,
        max_seq_len: int,
        max_batch_size: int,
        model_parallel_size: Optional[int] = None,
        seed: int = 1,
        device: Optional[Union[str, torch.device]] = None,
        dtype: Optional[Union[str, torch.dtype]] = None,
        verify: bool = False,
        compile: Union[bool, str, None] = "auto",
        quantize: Optional[str] = None,
    ) -> "Llama":
        """Load a Meta-layout checkpoint; works in plain python and under torchrun, on CPU or CUDA.

        quantize="int8": int8 weight-only linear layers (activations bf16 unless dtype says otherwise);
        "int8-dynamic" (CPU): int8 weights and per-row dynamic int8 activations in oneDNN (llama/quantize.py).
        compile="auto" (default): on CPU, models of 50M+ parameters compile their one-token decode step for a batch
        size once eager decoding at it has cost what compiling would (tens of seconds), so short runs never wait
        and long ones end up compiled; True compiles each batch size on first use; "max-autotune"/"default" pick
        Inductor's mode; False never compiles (llama/compile.py).
        """
        model, tokenizer, _ = loader.load(ckpt_dir, tokenizer_path, max_seq_len, max_batch_size, model_parallel_size,
                                          seed, device, dtype, verify, compile, quantize)
        return Llama(model, tokenizer)

    def __init__(self, model: Transformer, tokenizer: Tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.formatter = ChatFormat(tokenizer)
        self.device = model.norm.weight.device
        self.lock = threading.RLock()  # the KV cache is one resource: one decode loop at a time
        self._stream_thread: Optional[int] = None  # the thread whose unfinished stream holds the cache

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.model.max_batch_size

    # ----------------------------------------------------------------------------------------- reference API
    def generate(
        self,
        prompt_tokens: List[List[int]],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        logprobs: bool = False,
        echo: bool = False,
    ) -> Tuple[List[List[int]], Optional[List[List[float]]]]:
        """Token-level generation with the reference's return shape: (tokens, logprobs or None).

        With echo, tokens include the prompt and logprobs[0] (the first prompt token's) is 0.0, as in the reference.
        """
        params = SamplingParams(temperature=temperature, top_p=top_p, max_gen_len=max_gen_len, logprobs=logprobs,
                                echo=echo)
        rows = self._complete(self._rows(prompt_tokens, [params] * _count(prompt_tokens, "prompt_tokens")))
        out_tokens = [(r.prompt if echo else []) + r.generated for r in rows]
        out_logprobs = [([0.0] + r.prompt_logprobs if echo else []) + r.logprobs for r in rows]
        return out_tokens, (out_logprobs if logprobs else None)

    def text_completion(
        self,
        prompts: List[str],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        echo: bool = False,
        *,
        prefix: Optional[Prefix] = None,
        n: int = 1,
        **options,
    ) -> List[CompletionPrediction]:
        """Complete each prompt; with n > 1 the result is prompt-major (result[i * n + j]).

        With a prefix (from prefill), each prompt continues it: its tokens are prefix.tokens + the prompt's.
        """
        prompts = _string_list("prompts", prompts)
        toks = [self._with_prefix(prefix, self.tokenizer.encode(p, bos=prefix is None, eos=False)) for p in prompts]
        params = self._params(len(prompts), temperature=temperature, top_p=top_p, max_gen_len=max_gen_len,
                              logprobs=logprobs, echo=echo, **options)
        rows = self._complete(self._rows(toks, params, n=n, prefix=prefix))
        return [self._prediction(r) for r in rows]

    def chat_completion(
        self,
        dialogs: List[Dialog],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        *,
        n: int = 1,
        **options,
    ) -> List[ChatPrediction]:
        """Answer each dialog as the assistant, using the Llama 2 chat template.

        A dialog containing the template's special tags gets the reference's error text as its answer; the rest
        of the batch runs normally.
        """
        _count(dialogs, "dialogs")
        for i, dialog in enumerate(dialogs):
            validate_dialog(dialog, i)
        params = self._params(len(dialogs), temperature=temperature, top_p=top_p, max_gen_len=max_gen_len,
                              logprobs=logprobs, **options)
        safe = [i for i, d in enumerate(dialogs) if not has_special_tags(d)]
        toks = [self.formatter.encode_dialog_prompt(dialogs[i]) for i in safe]
        rows = self._complete(self._rows(toks, [params[i] for i in safe], n=n, index=safe, chat=True))
        by_prompt = {i: rows[k * n : (k + 1) * n] for k, i in enumerate(safe)}
        out: List[ChatPrediction] = []
        for i in range(len(dialogs)):
            for j in range(n):
                if i in by_prompt:
                    pred = self._prediction(by_prompt[i][j])
                else:
                    pred = {"generation": UNSAFE_ERROR, **({"tokens": [], "logprobs": []} if logprobs else {})}
                pred["generation"] = {"role": "assistant", "content": pred["generation"]}
                out.append(pred)
        return out

    # ----------------------------------------------------------------------------------------- streaming
    def stream_completion(self, prompt: str, *, prefix: Optional[Prefix] = None, **options) -> Iterator[str]:
        """Yield text deltas of one completion as tokens arrive; their concatenation is the final text."""
        prompt = _string_list("prompt", [prompt])[0]
        toks = self._with_prefix(prefix, self.tokenizer.encode(prompt, bos=prefix is None, eos=False))
        return self._stream(self._rows([toks], self._params(1, **options), prefix=prefix)[0])

    def stream_chat(self, dialog: Dialog, **options) -> Iterator[str]:
        """Yield the assistant's reply to one dialog as text deltas."""
        validate_dialog(dialog)
        params = self._params(1, **options)
        if has_special_tags(dialog):
            return iter([UNSAFE_ERROR])
        return self._stream(self._rows([self.formatter.encode_dialog_prompt(dialog)], params, chat=True)[0])

    @contextmanager
    def using_cache(self, streaming: bool = False):
        """Hold the KV cache for one call. Other threads wait; in the thread of an unfinished stream (which holds
        the cache between its deltas) any other call would corrupt that stream, so it raises instead."""
        with self.lock:
            if self._stream_thread == threading.get_ident():
                raise RuntimeError("an unfinished stream of this Llama is open in this thread: "
                                   "consume it or close() it before another call")
            if streaming:
                self._stream_thread = threading.get_ident()
            try:
                yield
            finally:
                if streaming:
                    self._stream_thread = None

    def _stream(self, row: Row) -> Iterator[str]:
        with self.using_cache(streaming=True):
            for deltas in self._run([row]):
                for _, text in deltas:
                    yield text

    # ----------------------------------------------------------------------------------------- prefixes, chat
    def prefill(self, text_or_tokens: Union[str, List[int]]) -> Prefix:
        """Compute the KV cache of a shared prompt start once, to continue many prompts from it."""
        if isinstance(text_or_tokens, str):
            tokens = self.tokenizer.encode(text_or_tokens, bos=True, eos=False)
        else:
            tokens = self._check_tokens("prefix", text_or_tokens)
        if not tokens or len(tokens) >= self.max_seq_len:
            raise ValueError(f"prefix has {len(tokens)} tokens; it needs 1 to {self.max_seq_len - 1} (max_seq_len - 1)")
        with self.using_cache():
            logits = self.model(torch.tensor([tokens], device=self.device), 0)[0]
            return Prefix.snapshot(self.model, slot=0, tokens=tokens, logprobs=token_logprobs(logits, tokens),
                                   next_logprobs=torch.log_softmax(logits[-1], dim=-1))

    def chat_session(self, system: Optional[str] = None) -> ChatSession:
        """A multi-turn conversation that keeps its KV cache between turns."""
        return ChatSession(self, system)

    def engine(self, prefill_chunk: int = 128):
        """A continuous-batching engine over this generator's KV cache: submit requests from any thread.

        While it has requests in flight it owns the cache, so other calls on this generator wait until it is idle.
        """
        from .engine import Engine

        return Engine(self, prefill_chunk=prefill_chunk)

    # ----------------------------------------------------------------------------------------- scoring
    def score(self, texts: Sequence[Union[str, List[int]]]) -> List[Dict]:
        """Log-probability of every token of each text given all before it (BOS is context, not scored).

        Per text: tokens (pieces as text), token_ids, logprobs, total_logprob, perplexity. One forward pass per
        batch of max_batch_size texts.
        """
        _count(texts, "texts")
        seqs = []
        for i, t in enumerate(texts):
            toks = self.tokenizer.encode(t, bos=True, eos=False) if isinstance(t, str) else self._check_tokens(f"text {i}", t)
            if len(toks) < 2:
                raise ValueError(f"text {i} has {len(toks)} token(s): at least 2 are needed to score one")
            if len(toks) > self.max_seq_len:
                raise ValueError(f"text {i} has {len(toks)} tokens, more than max_seq_len={self.max_seq_len}")
            seqs.append(toks)
        results = []
        with self.using_cache():
            for start in range(0, len(seqs), self.max_batch_size):
                batch = seqs[start : start + self.max_batch_size]
                width = max(map(len, batch))
                logits = self.model(torch.tensor([s + [0] * (width - len(s)) for s in batch], device=self.device), 0)
                for b, toks in enumerate(batch):
                    lps = token_logprobs(logits[b, : len(toks)], toks)
                    total = sum(lps)
                    results.append({
                        "tokens": [self.tokenizer.decode([t]) for t in toks[1:]],
                        "token_ids": toks[1:],
                        "logprobs": lps,
                        "total_logprob": total,
                        "perplexity": float(torch.tensor(-total / len(lps), dtype=torch.float64).exp()),
                    })
        return results

    # ----------------------------------------------------------------------------------------- internals
    def _params(self, count: int, **options) -> List[SamplingParams]:
        """One SamplingParams per prompt from keyword options given once or once per prompt."""
        unknown = set(options) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        expanded = {k: per_prompt(k, v, count) for k, v in options.items()}
        return [SamplingParams(**{k: v[i] for k, v in expanded.items()}) for i in range(count)]

    def _check_tokens(self, name: str, tokens) -> List[int]:
        if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ValueError(f"{name} must be a list of token ids (ints)")
        bad = [t for t in tokens if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {self.model.vocab_size})")
        return list(tokens)

    def _with_prefix(self, prefix: Optional[Prefix], tokens: List[int]) -> List[int]:
        if prefix is None:
            return tokens
        if not isinstance(prefix, Prefix):
            raise ValueError(f"prefix must come from Llama.prefill(), got {type(prefix).__name__}")
        return prefix.tokens + tokens

    def _rows(self, prompts: List[List[int]], params: List[SamplingParams], n: int = 1,
              prefix: Optional[Prefix] = None, index: Optional[List[int]] = None, chat: bool = False) -> List[Row]:
        """Validate every prompt before any work starts; one Row per (prompt, sample), prompt-major.

        chat: the reply's first space is the template's separator after [/INST], not part of the content.
        """
        _positive_int("n", n)
        full = []
        for k, toks in enumerate(prompts):
            i = index[k] if index is not None else k
            toks = self._check_tokens(f"prompt {i}", toks)
            if not toks:
                raise ValueError(f"prompt {i} is empty: it needs at least one token")
            if len(toks) >= self.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(toks)} tokens; it must be shorter than max_seq_len={self.max_seq_len}"
                )
            full.append(toks)
        rows = []
        for toks, p in zip(full, params):
            room = self.max_seq_len - len(toks)
            max_new = min(p.max_gen_len, room) if p.max_gen_len is not None else room
            for j in range(n):
                stream = TextStream(self.tokenizer, context=toks, stop=p.stop, strip_space=chat)
                rows.append(Row(prompt=toks, params=p, max_new=max_new, stream=stream, sample=j, prefix=prefix))
        return rows

    def _complete(self, rows: List[Row]) -> List[Row]:
        """Run rows to completion: one static batch when they fit the cache, else continuous batching (a row
        starts as soon as a slot frees up), results in input order either way."""
        with self.using_cache():
            if len(rows) > self.max_batch_size:
                from .engine import Engine

                return Engine(self, mode="local").complete(rows)
            for start in range(0, len(rows), self.max_batch_size):
                for _ in self._run(rows[start : start + self.max_batch_size]):
                    pass
        return rows

    def _prediction(self, r: Row) -> Dict:
        text = r.stream.text
        if r.params.echo:
            text = self.tokenizer.decode(r.prompt) + text
        pred = {"generation": text}
        if r.params.logprobs:
            toks = (r.prompt if r.params.echo else []) + r.generated
            pred["tokens"] = [self.tokenizer.decode([t]) for t in toks]
            pred["logprobs"] = ([0.0] + r.prompt_logprobs if r.params.echo else []) + r.logprobs
        return pred

    def _prefill(self, rows: List[Row]) -> torch.Tensor:
        """Fill cache slots 0..len(rows)-1 with the prompts; return each row's next-token logits (B, V).

        Rows with the same prompt (n samples) are prefilled once and their cache copied; a prefix's cached
        positions are copied in instead of recomputed.
        """
        leaders: Dict[Tuple, int] = {}
        lead_of = [leaders.setdefault((tuple(r.prompt), id(r.prefix)), b) for b, r in enumerate(rows)]
        lead = sorted(leaders.values())
        full = any(rows[b].params.echo and rows[b].params.logprobs for b in lead)
        for b in lead:
            r = rows[b]
            if r.prefix is not None:
                r.reused = r.prefix.load_into(self.model, b, r.prompt)
                if full:
                    r.prompt_logprobs = r.prefix.prompt_logprobs(r.prompt, r.reused)
        next_logits = {}
        by_start: Dict[int, List[int]] = {}
        for b in lead:  # one pass per start position, so right-padding never runs past the cache
            by_start.setdefault(rows[b].reused, []).append(b)
        for start, group in by_start.items():
            width = max(len(rows[b].prompt) for b in group) - start
            x = torch.tensor([rows[b].prompt[start:] + [0] * (width - len(rows[b].prompt) + start) for b in group],
                             device=self.device)
            slots = None if group == list(range(len(group))) else torch.tensor(group, device=self.device)
            last = torch.tensor([len(rows[b].prompt) - start - 1 for b in group], device=self.device)
            logits = self.model(x, start, rows=slots, logit_index=None if full else last)
            for k, b in enumerate(group):
                r = rows[b]
                n_new = len(r.prompt) - start
                if full:
                    r.prompt_logprobs = r.prompt_logprobs + token_logprobs(logits[k, :n_new], r.prompt[start:])
                next_logits[b] = logits[k, n_new - 1 if full else 0]
        for b, a in enumerate(lead_of):
            if a != b:
                src, dst = torch.tensor([a], device=self.device), torch.tensor([b], device=self.device)
                self.model.copy_cache(src, dst, len(rows[b].prompt))
                rows[b].prompt_logprobs, rows[b].reused = rows[a].prompt_logprobs, rows[a].reused
        return torch.stack([next_logits[a] for a in lead_of])

    def _run(self, rows: List[Row]) -> Iterator[List[Tuple[int, str]]]:
        """The decode loop for one batch: yields, per step, (row index, text delta) for rows with new text."""
        dev = self.device
        logits = self._prefill(rows)
        draw = RowSampler(rows, dev)
        feed_tok = [r.prompt[-1] for r in rows]
        feed_pos = [len(r.prompt) - 1 for r in rows]
        while True:
            if any(r.params.logits_processors for r in rows):
                logits = logits.clone()  # the model returns inference tensors, which processors cannot edit in place
            for b, r in enumerate(rows):
                if r.finish_reason is None:
                    for proc in r.params.logits_processors:
                        logits[b] = proc(list(r.generated), logits[b])
            next_tok, lp = draw(logits)
            deltas = []
            for b, (r, tok) in enumerate(zip(rows, next_tok)):
                if r.finish_reason is not None:
                    continue
                text = r.advance(tok, self.tokenizer.eos_id, lp[b] if lp is not None else None)
                if r.finish_reason is None:
                    feed_tok[b], feed_pos[b] = tok, r.next_pos
                if text:
                    deltas.append((b, text))
            yield deltas
            if all(r.finish_reason is not None for r in rows):
                return
            x = torch.tensor(feed_tok, device=dev)[:, None]
            pos = feed_pos[0] if len(set(feed_pos)) == 1 else torch.tensor(feed_pos, device=dev)
            logits = self.model(x, pos)[:, 0]


def _count(values, name: str) -> int:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(values).__name__}")
    return len(values)


def _string_list(name: str, values) -> List[str]:
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{name} must be a list of strings")
    return list(values)
