"""Llama: Meta's reference API (build, generate, text_completion, chat_completion) as a thin facade.

Every method builds Requests (llama/core/frontend/inputs.py) and runs them through the one decode core (llama/core/frontend/decode_core.py) while
holding the KV cache (llama/core/worker/kv_cache.py); the return shapes are the reference's.
"""

import logging
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypedDict, Union

import torch

from llama.config import BuildArgs, LlamaConfig, memory_config
from llama.core.frontend.decode_core import DecodeCore
from llama.core.speculation.draft_model import DraftModel
from llama.core.frontend.engine import Engine
from llama.core.frontend.inputs import RequestBuilder, count, expand_params, refusal_prediction, string_list
from llama.core.worker.kv_cache import build_cache
from llama.core.frontend.params import SamplingParams
from llama.core.frontend.prefix import Prefix
from llama.core.frontend.request import BatchError, Request
from llama.core.worker.runner import Execution, Runner
from llama.core.frontend.session import ChatSession
from llama.distributed import parallel, pipeline
from llama.loading import loader
from llama.sample.sampling import sample_top_p, token_logprobs
from llama.tokenizer import Tokenizer
from llama.tokenizers import reasoning
from llama.tokenizers.chat_format import (B_INST, B_SYS, E_INST, E_SYS, SPECIAL_TAGS, UNSAFE_ERROR, ChatFormat, Dialog,
                                          Message, Role, chat_format_for, check_template_kwargs,
                                          with_template_kwargs)
from llama.tokenizers.text import check_text

# Meta's names in its llama.generation (Llama 2's and Llama 3's repositories), for code written against them.
log = logging.getLogger("llama")

__all__ = ["Llama", "CompletionPrediction", "ChatPrediction", "sample_top_p", "Role", "Message", "Dialog", "B_INST",
           "E_INST", "B_SYS", "E_SYS", "SPECIAL_TAGS", "UNSAFE_ERROR", "Tokenizer", "ChatFormat"]


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


class ChatPrediction(TypedDict, total=False):
    generation: Message
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


def execution_for(model) -> Execution:
    """How the runner's passes run across ranks: a pipeline stage's own strategy, else one stage whose engine
    replays its steps on the tensor-parallel ranks (if any)."""
    if isinstance(model, pipeline.PipelineTransformer):
        return pipeline.PipelineExecution(model)
    return Execution(lockstep=parallel.lockstep_group())


def _draft_config(args: BuildArgs) -> LlamaConfig:
    """The draft model's configuration (BuildArgs.draft), resolved before the model loads: a bad draft is refused
    first, named."""
    try:
        return args.draft().resolve()
    except ValueError as e:
        raise ValueError(f"draft_model={args.draft_model!r}: {e}") from None


def _load_draft(draft: LlamaConfig, vocab: int) -> DraftModel:
    """The draft model: on the model's device, in its dtype, eager, with a KV cache of its own."""
    name = f"draft_model={draft.model.path!r}"
    try:
        drafting = Llama.from_config(draft)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return DraftModel(drafting.runner, vocab, name)


class Llama:
    @staticmethod
    def build(ckpt_dir: str, tokenizer_path: Optional[str], max_seq_len: int, max_batch_size: int,
              model_parallel_size: Optional[int] = None, seed: int = 1, **options) -> "Llama":
        """Load a checkpoint: a Meta-layout directory, a Hugging Face directory, or a GGUF file (or a directory
        holding one; its embedded tokenizer and chat template are used unless tokenizer_path is given). Works in
        plain python and under torchrun, on CPU or CUDA.

        Meta's arguments, then keyword options: device, dtype, verify, compile, quantize, group_size,
        rope_scaling_factor, pipeline_parallel_size, preload, kv_cache_memory, prefix_cache, kv_cache_dtype,
        tool_style, speculative, draft_model; llama.config.BuildArgs says what each does. They are checked and
        resolved once into a LlamaConfig (llama/config/), readable afterwards as Llama.config; options that
        exclude each other are refused before anything loads.
        """
        args = BuildArgs.of(ckpt_dir=ckpt_dir, tokenizer_path=tokenizer_path, max_seq_len=max_seq_len,
                            max_batch_size=max_batch_size, model_parallel_size=model_parallel_size, seed=seed,
                            **options)
        config = args.resolve()
        return Llama.from_config(config, None if args.draft_model is None else _draft_config(args))

    @staticmethod
    def from_config(config: LlamaConfig, draft: Optional[LlamaConfig] = None) -> "Llama":
        """A generator as a resolved configuration says (BuildArgs.resolve); draft: the draft model's (under
        speculative="draft")."""
        if parallel.is_main_process():
            log.info("llama config: %s", config.summary())
        model, tokenizer, compiled = loader.load(config)
        drafter = None if draft is None else _load_draft(draft, model.vocab_size)
        return Llama(model, tokenizer, config=config, compiled=compiled, draft=drafter)

    def __init__(self, model, tokenizer, *, config: Optional[LlamaConfig] = None, compiled=None,
                 draft: Optional[DraftModel] = None):
        """Meta's Llama(model, tokenizer) sizes the KV cache from model.params (memory_config); config: the
        resolved configuration (Llama.build's, or llama.config.memory_config's for a model built by hand);
        compiled: the model's compiled decode step, if config.compile asks for one; draft: the draft model."""
        config = memory_config(model) if config is None else config
        if compiled is not None and config.compile.eager:
            raise ValueError("a compiled decode step was given with compile=False: pass the configuration that "
                             "asked for it")
        if (config.speculative.mode == "draft") != (draft is not None):
            raise ValueError("speculative='draft' needs the draft model (draft=) and a draft needs it")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.formatter = chat_format_for(tokenizer, model.params, config.tool_style)
        self.cache = build_cache(model, config.scheduler, config.cache,
                                 place=(parallel.model_parallel_rank(), parallel.pipeline_parallel_rank()),
                                 replicated=parallel.model_parallel_size() * parallel.pipeline_parallel_size() > 1)
        self.device = self.cache.device
        self.runner = Runner(model, self.cache, compiled, execution_for(model))
        self.inputs = RequestBuilder(tokenizer, self.formatter, config.scheduler.max_seq_len, model.vocab_size)
        # A verify pass's rows are bitwise one-token steps in our CPU kernels only: on CUDA they were 8.6e-6 apart
        # (docs/performance.md, "The GPU"), so there predictions are ignored (and speculation refused:
        # llama/config/checks.py). A compiled step verifies through its own graph (bitwise where
        # verifies_exactly(): fp32 in our kernels); compile="auto"'s switch from eager to compiled steps is timed,
        # so there predictions are ignored.
        lazy = compiled is not None and compiled.lazy
        predictions = self.device.type == "cpu" and (compiled is None or (not lazy and compiled.verifies_exactly()))
        self.core = DecodeCore(self.runner, self.inputs.settle, config.scheduler, config.speculative.mode,
                               predictions, draft)

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.cache.max_batch_size

    @property
    def lock(self):
        """The KV cache's lock: held by whatever is decoding (a call, a stream, the engine)."""
        return self.cache.lock

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
        reqs = self._complete(self.inputs.requests(prompt_tokens, [params] * count(prompt_tokens, "prompt_tokens")),
                              lambda r: r)
        out_tokens = [(r.prompt if echo else []) + r.generated for r in reqs]
        out_logprobs = [([0.0] + r.prompt_logprobs if echo else []) + r.logprobs for r in reqs]
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
        Options: any SamplingParams field (top_k, seed, stop, logits_processors), once or one per prompt.
        """
        prompts = string_list("prompts", prompts)
        toks = [self.inputs.encode_text(p, prefix) for p in prompts]
        params = expand_params(len(prompts), temperature=temperature, top_p=top_p, max_gen_len=max_gen_len,
                               logprobs=logprobs, echo=echo, **options)
        return self._complete(self.inputs.requests(toks, params, n=n, prefix=prefix))

    def chat_completion(
        self,
        dialogs: List[Dialog],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        *,
        n: int = 1,
        split_reasoning: bool = False,
        chat_template_kwargs: Optional[Dict] = None,
        **options,
    ) -> List[ChatPrediction]:
        """Answer each dialog as the assistant, in the checkpoint's chat format.

        A dialog the format refuses (Llama 2: one containing its special tags) gets the reference's error text as
        its answer; the rest of the batch runs normally. A reasoning model's <think> block stays in the content
        unless split_reasoning: then it moves to generation["reasoning_content"] (llama/tokenizers/reasoning.py).
        chat_template_kwargs: extra variables of the model's Jinja template, e.g. {"enable_thinking": False} to
        turn Qwen3's thinking off (as transformers' apply_chat_template and vLLM take them).
        """
        count(dialogs, "dialogs")
        extra = check_template_kwargs(chat_template_kwargs)
        encoded = [self.inputs.encode_dialog(with_template_kwargs(d, extra), i) for i, d in enumerate(dialogs)]
        params = expand_params(len(dialogs), temperature=temperature, top_p=top_p, max_gen_len=max_gen_len,
                               logprobs=logprobs, **options)
        run = [i for i, (toks, _) in enumerate(encoded) if toks is not None]
        reqs = self.inputs.requests([encoded[i][0] for i in run], [params[i] for i in run], n=n, index=run, chat=True)
        preds, errors = iter(self._complete(reqs, check=False)), iter(r.error for r in reqs)
        out, failed = [], []
        for (toks, refusal), p in zip(encoded, params):
            for _ in range(n):
                out.append(next(preds) if toks is not None else refusal_prediction(refusal, logprobs, p.top_logprobs))
                failed.append(next(errors) if toks is not None else None)
        _check(out, failed)
        if split_reasoning:
            reasoning.split_predictions(out, [toks is not None and reasoning.prompt_opens_think(self.tokenizer, toks)
                                              for toks, _ in encoded for _ in range(n)])
        return out

    # ----------------------------------------------------------------------------------------- streaming
    def stream_completion(self, prompt: str, *, prefix: Optional[Prefix] = None, **options) -> Iterator[str]:
        """Yield text deltas of one completion as tokens arrive; their concatenation is the final text."""
        prompt = string_list("prompt", [prompt])[0]
        toks = self.inputs.encode_text(prompt, prefix)
        return self.stream_request(self.inputs.requests([toks], expand_params(1, **options), prefix=prefix)[0])

    def stream_chat(self, dialog: Dialog, *, chat_template_kwargs: Optional[Dict] = None,
                    **options) -> Iterator[str]:
        """Yield the assistant's reply to one dialog as text deltas (chat_template_kwargs: as chat_completion)."""
        toks, refusal = self.inputs.encode_dialog(with_template_kwargs(dialog, check_template_kwargs(
            chat_template_kwargs)))
        params = expand_params(1, **options)
        if refusal is not None:
            return iter([refusal])
        return self.stream_request(self.inputs.requests([toks], params, chat=True)[0])

    def stream_request(self, req: Request, finish: Optional[Callable[[Request], None]] = None) -> Iterator[str]:
        """Run one built request, yielding its text deltas; the stream holds the cache until it ends. finish(req)
        runs before the cache is released (a chat session keeps the request's blocks there)."""
        with self.cache.hold(streaming=True):
            for deltas in self.core.run([req]):
                for _, text in deltas:
                    yield text
            if req.error is not None:
                raise req.error
            if finish is not None:
                finish(req)

    # ----------------------------------------------------------------------------------------- prefixes, chat
    def prefill(self, text_or_tokens: Union[str, List[int]]) -> Prefix:
        """Compute the KV cache of a shared prompt start once, to continue many prompts from it."""
        if isinstance(text_or_tokens, str):
            tokens = self.tokenizer.encode(text_or_tokens, bos=True, eos=False)
        else:
            tokens = self.inputs.check_tokens("prefix", text_or_tokens)
        if not tokens or len(tokens) >= self.max_seq_len:
            raise ValueError(f"prefix has {len(tokens)} tokens; it needs 1 to {self.max_seq_len - 1} (max_seq_len - 1)")
        with self.cache.hold():
            logits = self.runner.logits([tokens])[0]
            return Prefix.from_slot(self.cache, 0, tokens, logprobs=token_logprobs(logits, tokens),
                                    next_logprobs=torch.log_softmax(logits[-1], dim=-1))

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix block (waits for the cache: running requests keep their blocks)."""
        with self.cache.hold():
            self.cache.pool.clear()

    def chat_session(self, system: Optional[str] = None) -> ChatSession:
        """A multi-turn conversation that keeps its KV cache between turns."""
        return ChatSession(self, system)

    def engine(self, prefill_chunk: int = 128, overlap: Optional[bool] = None) -> Engine:
        """A continuous-batching engine over this generator's KV cache: submit requests from any thread.

        While it has requests in flight it owns the cache, so other calls on this generator wait until it is idle.
        overlap (pipeline stages; rank 0's choice counts): keep one group of requests per stage in flight so the
        stages work at once (default), or False for one step at a time.
        """
        return Engine(self, prefill_chunk=prefill_chunk, overlap=overlap)

    # ----------------------------------------------------------------------------------------- scoring
    def score(self, texts: Sequence[Union[str, List[int]]]) -> List[Dict]:
        """Log-probability of every token of each text given all before it (BOS is context, not scored).

        Per text: tokens (pieces as text), token_ids, logprobs, total_logprob, perplexity. One forward pass per
        batch of max_batch_size texts.
        """
        count(texts, "texts")
        seqs = []
        for i, t in enumerate(texts):
            if isinstance(t, str):
                toks = self.tokenizer.encode(check_text(f"text {i}", t), bos=True, eos=False)
            else:
                toks = self.inputs.check_tokens(f"text {i}", t)
            if len(toks) < 2:
                raise ValueError(f"text {i} has {len(toks)} token(s): at least 2 are needed to score one")
            if len(toks) > self.max_seq_len:
                raise ValueError(f"text {i} has {len(toks)} tokens, more than max_seq_len={self.max_seq_len}")
            seqs.append(toks)
        results = []
        with self.cache.hold():
            for start in range(0, len(seqs), self.max_batch_size):
                batch = seqs[start : start + self.max_batch_size]
                logits = self.runner.logits(batch)
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
    def _complete(self, reqs: List[Request], result=None, check: bool = True) -> List:
        """Run requests through the decode core; each one's result (its prediction by default), None where it
        failed, in input order. check: raise BatchError if any failed (it keeps the others' results)."""
        with self.cache.hold():
            for _ in self.core.run(reqs):
                pass
        out = [None if r.error is not None else (result(r) if result else r.prediction) for r in reqs]
        if check:
            _check(out, [r.error for r in reqs])
        return out


def _check(results: List, errors: List[Optional[BaseException]]) -> None:
    failed = {i: e for i, e in enumerate(errors) if e is not None}
    if failed:
        raise BatchError(failed, results)
