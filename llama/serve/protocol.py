"""The OpenAI wire format: validating a request body into engine submissions, and shaping what the engine
returns into completion and chat-completion objects (whole or as stream chunks).

Every problem with a body raises `APIError` (status, message naming the field and the limit, param), which the
app turns into `{"error": {"message", "type", "param", "code"}}`; nothing a client sends reaches a bare assert.
"""

import numbers
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from llama.core.frontend.params import wire_params
from llama.tokenizers.chat_format import template_kwarg_problem, with_template_kwargs
from llama.tokenizers.messages import NO_VISION, is_image
from llama.tokenizers.text import check_text

FINISH = {"length": "length", "cancelled": "abort", "error": "error"}  # every stop token / stop string -> "stop"

# OpenAI fields accepted only with a value that changes nothing here: field -> predicate on the value.
HARMLESS = {
    "user": lambda v: v is None or isinstance(v, str),
    "metadata": lambda v: v is None or isinstance(v, dict),
    "store": lambda v: v in (None, False),
    "service_tier": lambda v: v in (None, "auto", "default"),
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none", "auto"),
    "modalities": lambda v: v in (None, ["text"]),
    "suffix": lambda v: v in (None, ""),
    "audio": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
}
# The fields this module maps itself; every sampling parameter with a wire field (temperature, top_p, top_k, seed,
# the penalties, any registered one) is allowed and checked from its declaration (llama/core/frontend/param_registry.py).
COMMON = {"model", "max_tokens", "n", "stop", "stream", "stream_options", "logprobs", "logit_bias",
          "response_format", "min_p", "prediction"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "parallel_tool_calls", "chat_template_kwargs"}  # tools: llama/serve/tools.py
PREDICTION_CHARS_PER_TOKEN = 32  # a prediction longer than this many characters per position cannot fit a sequence
ROLES = ("system", "user", "assistant", "tool", "ipython", "developer")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: Optional[str] = None, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")

    def body(self) -> Dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


@dataclass
class Job:
    """One validated request: what to submit to the engine (prompts x n) and how to answer."""

    chat: bool
    model: str
    prompts: List[object]  # each a str, a list of token ids or a dialog
    n: int
    params: Dict  # SamplingParams keywords
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    response_format: Optional[Dict] = None
    tools: Optional[object] = None  # llama.serve.tools.Tools
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id


def _int(body: Dict, name: str, default, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        limit = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(name, f"{name} must be {limit}, got {v}")
    return v


def _token_ids(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse(body, chat: bool, model_name: str, max_seq_len: int, vocab_size: int) -> Job:
    """Validate a /v1/completions (chat False) or /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    wired = wire_params()
    allowed = (CHAT_FIELDS if chat else COMPLETION_FIELDS) | {p.field for p in wired}
    for k, v in body.items():
        if k in HARMLESS:
            if not HARMLESS[k](v):
                raise bad(k, f"{k}={v!r} is not supported by this server")
        elif k not in allowed:
            raise APIError(400, f"unrecognized request argument: {k}", param=k, code="unknown_parameter")
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    n = _int(body, "n", 1, 1, 128)
    if not chat and body.get("best_of") not in (None, n):
        raise bad("best_of", f"best_of must equal n ({n}) or be omitted, got {body['best_of']!r}")
    params: Dict = {}
    for p in wired:
        try:
            params[p.name] = p.from_wire(body)
        except ValueError as e:
            raise bad(p.field, str(e)) from None
    if body.get("min_p") not in (None, 0):
        raise bad("min_p", f"min_p={body['min_p']!r} is not supported (only 0)")
    tokens_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, tokens_name, None if chat else 16, 1, None)
    if max_tokens is not None:
        params["max_gen_len"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
            raise bad("stop", "stop must be a non-empty string or a list of at most 16 non-empty strings")
        params["stop"] = stop
    job = Job(chat=chat, model=model_name, prompts=[], n=n, params=params)
    job.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options", "stream_options must be an object with include_usage")
        if not job.stream:
            raise bad("stream_options", "stream_options is only allowed with stream=true")
        job.include_usage = _bool(opts, "include_usage", "stream_options.include_usage")
    if chat:
        job.logprobs = _bool(body, "logprobs")
        job.top_logprobs = _int(body, "top_logprobs", 0, 0, 20)
        if job.top_logprobs and not job.logprobs:
            raise bad("top_logprobs", "top_logprobs needs logprobs=true")
        job.prompts = [with_template_kwargs(_dialog(body.get("messages")),
                                            _template_kwargs(body.get("chat_template_kwargs")))]
    else:
        lp = _int(body, "logprobs", None, 0, 5)
        job.logprobs, job.top_logprobs = lp is not None, lp or 0
        job.echo = _bool(body, "echo")
        job.prompts = _prompts(body.get("prompt"), vocab_size)
    params["logprobs"], params["top_logprobs"], params["echo"] = job.logprobs, job.top_logprobs, job.echo
    bias = body.get("logit_bias")
    if bias:
        params["logits_processors"] = [_logit_bias(bias, vocab_size)]
    job.response_format = _response_format(body.get("response_format"))
    prediction = _prediction(body.get("prediction"), max_seq_len)
    if prediction is not None:
        params["prediction"] = prediction
    return job


def _bool(body: Dict, name: str, param: Optional[str] = None) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(param or name, f"{param or name} must be true or false, got {v!r}")
    return v


def _prompts(prompt, vocab_size: int) -> List[object]:
    if isinstance(prompt, str):
        return [prompt]
    if _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(_token_ids(p) for p in prompt):
        return list(prompt)
    raise bad("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                        "token ids (none empty)")


def _dialog(messages) -> List[Dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    dialog = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            content = _text_parts(content, f"messages[{i}].content")
        if content is None and m.get("tool_calls"):  # an assistant's calls (checked in llama/serve/tools.py)
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")
        role = "system" if m["role"] == "developer" else m["role"]
        dialog.append({"role": role, "content": content, **_reasoning(i, m)})
    return dialog


def _reasoning(i: int, m: Dict) -> Dict:
    """An assistant message's reasoning_content as a response gave it: passed to the template, which may show it
    (Qwen3's shows it in the turns after the last user message, a tool-calling loop's)."""
    thought = m.get("reasoning_content")
    if thought is None:
        return {}
    if m["role"] != "assistant" or not isinstance(thought, str):
        raise bad(f"messages[{i}].reasoning_content", f"messages[{i}].reasoning_content must be a string, on an "
                                                      "assistant message")
    try:
        return {"reasoning_content": check_text(f"messages[{i}].reasoning_content", thought)}
    except ValueError as e:
        raise bad(f"messages[{i}].reasoning_content", str(e)) from None


def _template_kwargs(kwargs) -> Dict:
    """vLLM's and SGLang's chat_template_kwargs: extra variables of the model's chat template (Qwen3's
    {"enable_thinking": false}); unknown keys pass through, as vLLM passes them."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "chat_template_kwargs must be an object of template variables, e.g. "
                                          '{"enable_thinking": false}')
    for key, value in kwargs.items():
        problem = template_kwarg_problem(key, value)
        if problem is not None:
            raise bad(f"chat_template_kwargs.{key}", f"chat_template_kwargs: {problem}")
    return dict(kwargs)


def _text_parts(parts: list, where: str) -> str:
    """The text of OpenAI content parts; a part that is not text is a 400 naming it (where[j])."""
    texts = []
    for j, part in enumerate(parts):
        if is_image(part):
            raise bad(f"{where}[{j}]", f"{where}[{j}]: {NO_VISION}")
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}]", f"{where}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                      "supported")
        texts.append(part["text"])
    return "".join(texts)


def _prediction(v, max_seq_len: int) -> Optional[str]:
    """OpenAI's Predicted Outputs: {"type": "content", "content": a string or text parts}, as its text."""
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("type") != "content" or set(v) != {"type", "content"}:
        raise bad("prediction", 'prediction must be {"type": "content", "content": a string or a list of text parts}')
    content = v["content"]
    if isinstance(content, list):
        content = _text_parts(content, "prediction.content")
    if not isinstance(content, str):
        raise bad("prediction.content", "prediction.content must be a string or a list of text parts")
    if len(content) > PREDICTION_CHARS_PER_TOKEN * max_seq_len:
        raise bad("prediction.content", f"prediction.content has {len(content)} characters; at most "
                                        f"{PREDICTION_CHARS_PER_TOKEN * max_seq_len} ({PREDICTION_CHARS_PER_TOKEN} "
                                        f"per position of max_seq_len={max_seq_len})")
    return content


def _logit_bias(bias, vocab_size: int):
    if not isinstance(bias, dict):
        raise bad("logit_bias", "logit_bias must be an object mapping token ids to numbers in [-100, 100]")
    ids, vals = [], []
    for k, v in bias.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"logit_bias key {k!r} is not a token id") from None
        if not 0 <= t < vocab_size:
            raise bad("logit_bias", f"logit_bias token id {t} is outside the vocabulary [0, {vocab_size})")
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not -100 <= v <= 100:
            raise bad("logit_bias", f"logit_bias[{k}] must be a number in [-100, 100], got {v!r}")
        ids.append(t)
        vals.append(float(v))

    def logit_bias(_generated, logits):
        import torch

        idx = torch.tensor(ids, device=logits.device)
        logits[idx] += torch.tensor(vals, device=logits.device, dtype=logits.dtype)
        return logits

    return logit_bias


def _response_format(rf) -> Optional[Dict]:
    """None for plain text, else the structured-output spec for llama.sample.grammar."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("response_format", "response_format.type must be text, json_object or json_schema")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"json_object": True}
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise bad("response_format.json_schema", "response_format.json_schema must be an object with a "
                                                 "schema object (and name, strict)")
    return {"json_schema": js.get("schema", {})}


# ------------------------------------------------------------------------------------------------ responses
def finish_reason(r) -> Optional[str]:
    if r.finish_reason is None:
        return None
    if r.finish_reason == "error" and r.error is None:  # a dialog the chat format refuses, answered with its text
        return "stop"
    return FINISH.get(r.finish_reason, "stop")


def usage(prompt: int, completion: int, cached: int = 0, reqs=()) -> Dict:
    """OpenAI's usage; cached: prompt tokens read from the prefix cache instead of computed; reqs: the requests,
    whose predictions' drafted tokens were accepted or rejected (llama/core/speculation/speculative.py)."""
    predicted = [r for r in reqs if getattr(r, "predicted", None) is not None]
    accepted = sum(r.accepted for r in predicted)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": sum(r.drafted for r in predicted) - accepted}}


def logprobs_block(job: Job, pred: Dict, offset: int = 0) -> Dict:
    """A finished request's scores in the endpoint's shape. pred: the engine's prediction (tokens, logprobs and,
    with top_logprobs, each position's alternatives); with echo the first prompt token has no context: null."""
    tokens, lps = list(pred.get("tokens", [])), list(pred.get("logprobs", []))
    tops = list(pred.get("top_logprobs", [])) if job.top_logprobs else [[] for _ in tokens]
    if job.echo and lps:
        lps[0] = None
    if job.chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")),
                             "top_logprobs": [{"token": a["token"], "logprob": a["logprob"],
                                               "bytes": list(a["token"].encode("utf-8"))} for a in top]}
                            for t, lp, top in zip(tokens, lps, tops)]}
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top_block = None
    if job.top_logprobs:
        top_block = [_best_per_piece(top) if k or not job.echo else None for k, top in enumerate(tops)]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_block, "text_offset": offsets}


def _best_per_piece(top: List[Dict]) -> Dict[str, float]:
    """Completions' {piece: logprob}, best first; a piece that several ids decode to keeps its best."""
    out: Dict[str, float] = {}
    for a in top:
        out.setdefault(a["token"], a["logprob"])
    return out


def choice(job: Job, index: int, r, tokenizer) -> Dict:
    """A finished request as one choice of a whole (non-streamed) response."""
    pred = r.prediction
    out: Dict = {"index": index, "finish_reason": finish_reason(r)}
    if job.chat:
        out["message"] = {"role": "assistant", "content": pred["generation"]["content"]}
        out["logprobs"] = None
    else:
        out["text"] = pred["generation"]
        out["logprobs"] = None
    if job.logprobs:
        out["logprobs"] = logprobs_block(job, pred)
    return out


def whole(job: Job, reqs: List, tokenizer) -> Dict:
    prompt_tokens = sum(len(reqs[i * job.n].prompt) for i in range(len(job.prompts)))
    completion = sum(r.tokens_generated for r in reqs)
    cached = sum(reqs[i * job.n].reused for i in range(len(job.prompts)))
    return {
        "id": job.object_id, "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created, "model": job.model, "system_fingerprint": None,
        "choices": [choice(job, i, r, tokenizer) for i, r in enumerate(reqs)],
        "usage": usage(prompt_tokens, completion, cached, reqs),
    }


def chunk(job: Job, choices: List[Dict], usage_: Optional[Dict] = None) -> Dict:
    out = {"id": job.object_id, "object": "chat.completion.chunk" if job.chat else "text_completion",
           "created": job.created, "model": job.model, "system_fingerprint": None, "choices": choices}
    if job.include_usage:
        out["usage"] = usage_
    return out


def delta_choice(job: Job, index: int, text: Optional[str], finish: Optional[str] = None,
                 logprobs: Optional[Dict] = None, first: bool = False) -> Dict:
    if job.chat:
        delta: Dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
