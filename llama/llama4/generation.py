"""llama-models' `llama_models.llama4.generation` names, for code written against it: `Llama4.build(ckpt_dir,
max_seq_len, max_batch_size, world_size=None, quantization_mode=None, seed=1)`, then `generate(llm_inputs, ...)`,
`completion(contents, ...)` and `chat_completion(messages_batch, ...)`, each yielding per step a list of
`GenerationResult`, one per batch item, as Meta's do: a step per position from the shortest prompt's end (with
echo, first a step per prompt position), positions still inside an item's prompt marked ignore_token, an item's
stop token (<|end_of_text|>, <|eot|>, <|eom|>) marked finished, every item's run max_gen_len tokens past the
longest prompt's end.

Underneath is this package's `Llama` (Llama.build, its decode core and KV cache): Llama4.llama, with `model`
(llama.model.Transformer), `tokenizer` and `formatter` (llama.llama4.chat_format.ChatFormat); `args` is Meta's
ModelArgs of params.json (`Llama4(llama, args)` wraps a Llama built otherwise). The tokenizer is
ckpt_dir/tokenizer.model, else the one llama-models ships (if it is installed). Keyword options after Meta's
arguments go to Llama.build (device, dtype, quantize, ...).

Differences: an item that has stopped while others run yields its pad token, ignore_token and finished (Meta's
keeps decoding it); sampling at temperature > 0 is this package's sampler; logits_processor is called once per
item and step, with that item's tokens (1, cur_pos) and its next-token logits (1, 1, vocab); a prompt of
max_seq_len tokens or more is a ValueError (Meta's prints and yields nothing); images, quantization_mode and a
tokenizer that is not Llama 4's are refused naming what is missing.
"""

from contextlib import closing
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import torch

from llama.core.frontend.params import SamplingParams
from llama.formats import llama4 as formats
from llama.formats.meta_checkpoint import read_json_object
from llama import settings
from llama.generation import Llama
from llama.llama4.args import ModelArgs
from llama.llama4.chat_format import ChatFormat
from llama.llama4.datatypes import LLMInput
from llama.quantization import registry
from llama.tokenizers.llama4 import Llama4Tokenizer


@dataclass
class GenerationResult:
    """llama-models' GenerationResult: one batch item's token at one step."""

    token: int
    text: str
    source: str  # "input" (an echoed prompt token) or "output"
    batch_idx: int
    finished: bool  # the item has produced its stop token (at this step or before)
    ignore_token: bool  # not a generated token of this item: its prompt, its padding, or past its stop
    logprobs: Optional[List[float]] = None


def tokenizer_path(ckpt_dir) -> str:
    """ckpt_dir/tokenizer.model, else llama-models' llama4/tokenizer.model (Meta's Tokenizer.get_instance)."""
    local = Path(ckpt_dir) / "tokenizer.model"
    if local.is_file():
        return str(local)
    spec = find_spec("llama_models")
    shipped = Path(spec.submodule_search_locations[0]) / "llama4" / "tokenizer.model" if spec else None
    if shipped is not None and shipped.is_file():
        return str(shipped)
    where = f"is not at {shipped}" if shipped else "is not there (llama-models is not installed)"
    raise FileNotFoundError(f"no Llama 4 tokenizer: {local} does not exist, and llama-models' llama4/tokenizer.model "
                            f"{where}; put tokenizer.model in the checkpoint directory")


class Recorder:
    """A logits processor that keeps the log-probabilities of each step (Meta's logprobs: of the logits after any
    logits_processor), the last step's row whole (its token, a stop token, is known only to the caller)."""

    def __init__(self):
        self.done: List[float] = []
        self.row: Optional[torch.Tensor] = None

    def __call__(self, generated: List[int], row: torch.Tensor) -> torch.Tensor:
        if self.row is not None:
            self.done.append(float(self.row[generated[len(self.done)]]))
        self.row = torch.log_softmax(row.float(), dim=-1)
        return row

    def logprob(self, k: int, token: int) -> float:
        return self.done[k] if k < len(self.done) else float(self.row[token])


def meta_processor(proc: Callable, prompt: List[int]) -> Callable:
    """Meta's logits_processor(tokens (1, cur_pos), logits (1, 1, V)) as this package's per-row one."""
    def per_row(generated: List[int], row: torch.Tensor) -> torch.Tensor:
        out = proc(torch.tensor([prompt + generated], device=row.device), row.view(1, 1, -1))
        return out.reshape(-1, row.shape[-1])[-1] if isinstance(out, torch.Tensor) else out
    per_row.__qualname__ = getattr(proc, "__qualname__", type(proc).__name__)
    return per_row


class Llama4:
    @staticmethod
    def build(ckpt_dir: str, max_seq_len: int, max_batch_size: int, world_size: Optional[int] = None,
              quantization_mode=None, seed: int = 1, **options) -> "Llama4":
        """Meta's: a Meta-layout Llama 4 checkpoint (params.json, consolidated.*.pth) through Llama.build;
        world_size is its model_parallel_size."""
        if quantization_mode is not None:
            raise ValueError(f"quantization_mode={getattr(quantization_mode, 'value', quantization_mode)!r}: Meta's "
                             "fp8_mixed / int4_mixed are not implemented here; pass quantize= one of "
                             f"{', '.join(registry.names())} (this package's schemes) instead, or None")
        params = Path(ckpt_dir) / "params.json"
        if not params.is_file():
            raise FileNotFoundError(f"{params} not found: Llama4.build reads a Meta-layout checkpoint (params.json "
                                    "beside consolidated.*.pth); llama.Llama.build also reads Hugging Face and GGUF")
        args = ModelArgs(**read_json_object(params), max_seq_len=max_seq_len, max_batch_size=max_batch_size)
        llama = Llama.build(str(ckpt_dir), tokenizer_path(ckpt_dir), max_seq_len, max_batch_size,
                            model_parallel_size=world_size, seed=seed, **options)
        if args.vocab_size == -1:
            args.vocab_size = llama.tokenizer.n_words
        return Llama4(llama, args)

    def __init__(self, llama: Llama, args: ModelArgs):
        if not isinstance(llama.tokenizer, Llama4Tokenizer):
            raise ValueError(f"Llama4 needs Llama 4's tokenizer (its special tokens and chat format), got "
                             f"{type(llama.tokenizer).__name__}; llama.Llama runs other tokenizers")
        self.llama, self.args = llama, args
        self.model, self.tokenizer = llama.model, llama.tokenizer
        self.formatter = ChatFormat(self.tokenizer)

    def generate(self, llm_inputs: List[LLMInput], temperature: float = 0.6, top_p: float = 0.9,
                 max_gen_len: Optional[int] = None, logprobs: bool = False, echo: bool = False,
                 print_model_input: bool = False,
                 logits_processor: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                 ) -> Iterator[List[GenerationResult]]:
        """Meta's generate: per step, one GenerationResult per input (the inputs are checked before the first
        step). logits_processor(tokens, logits) -> logits runs through the decode core's per-row processors: once per
        item and step, with that item's tokens (1, cur_pos) and its next-token logits (1, 1, vocab)."""
        prompts = self.prompts(llm_inputs)
        max_seq = self.llama.max_seq_len
        if max_gen_len is not None and (not isinstance(max_gen_len, int) or isinstance(max_gen_len, bool)
                                        or max_gen_len < 0):
            raise ValueError(f"max_gen_len must be None or an integer >= 0, got {max_gen_len!r}")
        if not max_gen_len or max_gen_len >= max_seq:
            max_gen_len = max_seq - 1
        if logits_processor is not None and not callable(logits_processor):
            raise TypeError(f"logits_processor must be callable (tokens, logits) -> logits, got "
                            f"{type(logits_processor).__name__}")
        if print_model_input or settings.get().models_debug:
            print("Input to model:\n" + "\n".join(self.tokenizer.decode(p) for p in prompts))
        total_len = min(max_gen_len + max(map(len, prompts)), max_seq)
        recorders = [Recorder() if logprobs else None for _ in prompts]
        params = [SamplingParams(
            temperature=temperature, top_p=top_p, max_gen_len=max(1, total_len - len(p)), logprobs=logprobs,
            echo=logprobs, logits_processors=[f for f in (logits_processor and meta_processor(logits_processor, p),
                                                          rec) if f]) for p, rec in zip(prompts, recorders)]
        reqs = self.llama.inputs.requests(prompts, params)
        return self.steps(reqs, recorders, total_len, logprobs, echo)

    def prompts(self, llm_inputs: List[LLMInput]) -> List[List[int]]:
        """Each input's token ids; TypeError/ValueError naming an input that is not one, or that has images."""
        if not isinstance(llm_inputs, (list, tuple)) or not llm_inputs:
            raise ValueError("llm_inputs must be a non-empty list of LLMInput")
        out = []
        for i, inp in enumerate(llm_inputs):
            tokens = getattr(inp, "tokens", None)
            if tokens is None:
                raise TypeError(f"llm_inputs[{i}] must be an LLMInput (with .tokens), got {type(inp).__name__}")
            if getattr(inp, "images", None):
                raise ValueError(f"llm_inputs[{i}] has images: {formats.VISION}")
            if isinstance(tokens, torch.Tensor):
                if tokens.dim() != 1:
                    raise ValueError(f"llm_inputs[{i}].tokens must be one prompt's ids (a list or a 1-D tensor), "
                                     f"got a tensor of shape {tuple(tokens.shape)}")
                tokens = tokens.tolist()
            out.append(tokens)
        return out

    def steps(self, reqs, recorders, total_len: int, logprobs: bool, echo: bool) -> Iterator[List[GenerationResult]]:
        """Run the requests through the Llama's decode core, yielding each of Meta's steps as soon as every item's
        token at that position is known."""
        prompts = [r.prompt for r in reqs]
        if echo:
            pad = self.tokenizer.pad_id
            for i in range(max(map(len, prompts))):
                yield [GenerationResult(token=p[i] if i < len(p) else pad, text=self.tokenizer.decode(
                    [p[i] if i < len(p) else pad]), source="input", batch_idx=j, finished=False,
                    ignore_token=i >= len(p), logprobs=[0.0] if logprobs else None) for j, p in enumerate(prompts)]
        cur = min(map(len, prompts))
        with self.llama.cache.hold(streaming=True):
            for _ in self.llama.core.run(reqs):
                failed = next((r.error for r in reqs if r.error is not None), None)
                if failed is not None:
                    raise failed
                while cur < total_len and all(r.finished or cur < len(r.prompt) + len(r.generated) for r in reqs):
                    results = [self.result(j, r, recorders[j], cur) for j, r in enumerate(reqs)]
                    yield results
                    cur += 1
                    if all(res.finished for res in results):
                        return

    def result(self, j: int, r, recorder: Optional[Recorder], cur: int) -> GenerationResult:
        """Item j's result at position cur (known: inside its prompt, generated, its stop token, or past it)."""
        n, stops = len(r.prompt), {reason: tok for tok, reason in r.stop_tokens.items()}
        k = cur - n
        finished = r.finished and r.finish_reason in stops and k >= len(r.generated)
        if k < 0:
            token, ignore, lp = r.prompt[cur], True, lambda: r.prompt_logprobs[cur - 1]
        elif k < len(r.generated) or (finished and k == len(r.generated)):
            token = r.generated[k] if k < len(r.generated) else stops[r.finish_reason]
            ignore, lp = False, lambda: recorder.logprob(k, token)
        else:  # past its stop token: its pad, no text
            return GenerationResult(token=self.tokenizer.pad_id, text="", source="output", batch_idx=j,
                                    finished=True, ignore_token=True, logprobs=[0.0] if recorder else None)
        return GenerationResult(token=token, text=self.tokenizer.decode([token]), source="output", batch_idx=j,
                                finished=finished, ignore_token=ignore, logprobs=[lp()] if recorder else None)

    def completion(self, contents: list, temperature: float = 0.6, top_p: float = 0.9,
                   max_gen_len: Optional[int] = None, logprobs: bool = False,
                   echo: bool = False) -> Iterator[List[GenerationResult]]:
        """Meta's: each content (text, or a list of text items) completed; stops once every item has finished."""
        if not isinstance(contents, (list, tuple)) or not contents:
            raise ValueError("contents must be a non-empty list (one content per batch item)")
        inputs = [self.formatter.encode_content(c) for c in contents]
        return until_finished(self.generate(inputs, temperature, top_p, max_gen_len, logprobs, echo))

    def chat_completion(self, messages_batch: list, temperature: float = 0.6, top_p: float = 0.9,
                        max_gen_len: Optional[int] = None, logprobs: bool = False,
                        echo: bool = False) -> Iterator[List[GenerationResult]]:
        """Meta's: each dialog (llama-models' RawMessage objects or dicts) answered as the assistant."""
        if not isinstance(messages_batch, (list, tuple)) or not messages_batch:
            raise ValueError("messages_batch must be a non-empty list of dialogs (lists of messages)")
        inputs = [self.formatter.encode_dialog_prompt(m) for m in messages_batch]
        return until_finished(self.generate(inputs, temperature, top_p, max_gen_len, logprobs, echo))


def until_finished(steps: Iterator[List[GenerationResult]]) -> Iterator[List[GenerationResult]]:
    """Meta's completion loop: stop once every item has finished (closing the steps frees the Llama's cache)."""
    with closing(steps):
        for results in steps:
            yield results
            if all(r.finished for r in results):
                break
