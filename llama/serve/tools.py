"""Tool calling on /v1/chat/completions, OpenAI's wire format: `tools`, `tool_choice` and `parallel_tool_calls`
validated (a 400 naming the field), assistant `tool_calls` and `tool` messages in the history, the dialog and
grammar a request becomes, and the reply turned back into `tool_calls`, whole or as stream deltas (id, type and
name first, then the arguments in fragments, then finish_reason "tool_calls").

How each model family writes tools and calls is llama/tokenizers/tool_format.py; the grammars that keep calls
well-formed are llama/sample/tool_grammar.py.
"""

import json
import random
import string
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from llama.serve.protocol import bad
from llama.tokenizers import reasoning
from llama.tokenizers.tool_format import TRIGGERS, ToolDialog, family_of, parse

ID_CHARS = string.ascii_letters + string.digits
FRAGMENT = 16  # characters of arguments per stream delta


@dataclass
class Tools:
    """A request's tools (OpenAI's shape), its choice ("auto", "none", "required" or a function's name) and
    whether it allows several calls (never for a named function); family is set once the model's chat format is
    known."""

    tools: List[Dict]
    choice: str = "auto"
    parallel: bool = True
    family: str = "generic"
    seed: Optional[int] = None

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none" and bool(self.tools)


def parse_request(body: Dict) -> Optional[Tools]:
    """The request's tool fields, or None when it has none."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if tools is None and choice is None and parallel is None:
        return None
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise bad("tools", "tools must be a list of {\"type\": \"function\", \"function\": {name, description, "
                           "parameters}} objects")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}]", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c in ID_CHARS + "_-" for c in name):
            raise bad(f"tools[{i}].function.name", f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                                                   f"underscores or dashes, got {name!r}")
        if name in names:
            raise bad(f"tools[{i}].function.name", f"tools[{i}].function.name {name!r} is given twice")
        if not isinstance(fn.get("description", ""), str):
            raise bad(f"tools[{i}].function.description", f"tools[{i}].function.description must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", f"tools[{i}].function.parameters must be a JSON schema "
                                                         "object")
        names.append(name)
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"parallel_tool_calls must be true or false, got {parallel!r}")
    choice = _choice(choice, names)
    # A named function is called exactly once, whatever parallel_tool_calls says (as OpenAI and vLLM answer it):
    # its grammar then ends after one call.
    parallel = parallel is not False and choice in ("auto", "required", "none")
    return Tools(tools=[{"type": "function", "function": t["function"]} for t in tools],
                 choice=choice, parallel=parallel, seed=body.get("seed"))


def _choice(choice, names: List[str]) -> str:
    if choice is None:
        return "auto" if names else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not names:
            raise bad("tool_choice", "tool_choice \"required\" needs at least one tool in tools")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise bad("tool_choice", "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                                 "\"function\": {\"name\": ...}}")
    if fn["name"] not in names:
        raise bad("tool_choice", f"tool_choice names the function {fn['name']!r}, which is not among tools "
                                 f"({', '.join(names) or 'none given'})")
    return fn["name"]


def message_extras(i: int, m: Dict) -> Dict:
    """The tool fields of messages[i] (validated): an assistant's tool_calls (arguments as objects) or a tool
    message's tool_call_id."""
    out: Dict = {}
    calls = m.get("tool_calls")
    if calls is not None:
        where = f"messages[{i}].tool_calls"
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise bad(where, f"{where} must be a list, on an assistant message")
        out["tool_calls"] = [_history_call(f"{where}[{k}]", c) for k, c in enumerate(calls)]
    if m.get("role") == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise bad(f"messages[{i}].tool_call_id", f"messages[{i}] (role tool) needs tool_call_id, the id of the "
                                                     "call it answers")
        out["tool_call_id"] = tid
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def _history_call(where: str, c) -> Dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise bad(where, f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                         "\"arguments\"}}}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError as e:
            raise bad(f"{where}.function.arguments", f"{where}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise bad(f"{where}.function.arguments", f"{where}.function.arguments must be a JSON object")
    return {"id": c["id"], "name": fn["name"], "arguments": args}


def attach(spec, body: Dict, formatter) -> None:
    """Validate a chat request's tool fields and tool messages; with either, its prompt becomes a tool dialog."""
    spec.tools = parse_request(body)
    dialog = spec.prompts[0]
    for i, m in enumerate(dialog):
        for k in ("tool_calls", "tool_call_id", "name"):
            m.pop(k, None)
        m.update(message_extras(i, body["messages"][i]))
    if spec.tools is not None or any("tool_calls" in m or m["role"] == "tool" for m in dialog):
        prepare(spec, formatter)


def apply_whole(spec, response: Dict) -> None:
    """A whole response's choices with their replies' calls as tool_calls (finish_reason "tool_calls")."""
    if spec.tools is None:
        return
    for out in response["choices"]:
        content, calls = calls_of(spec, out["index"], out["message"]["content"])
        if calls:
            out["message"].update(content=content, tool_calls=calls)  # keeps a reasoning_content beside them
            out["finish_reason"] = "tool_calls"


def prepare(spec, formatter) -> None:
    """Turn a chat job with tools into a tool dialog and, when calls are allowed, the grammar that keeps them
    well-formed (forced for "required" or a named function, lazy for "auto")."""
    from llama.sample.tool_grammar import ToolGrammar  # llguidance is needed only by requests with tools

    if spec.tools is None:
        spec.tools = Tools(tools=[], choice="none")
    t = spec.tools
    t.family = family_of(formatter)
    shown = t.tools if t.choice != "none" else []
    spec.prompts = [ToolDialog(p, shown, t.family) for p in spec.prompts]  # keeping p's chat_template_kwargs
    if not t.calls_allowed:
        return
    if spec.response_format is not None:
        raise bad("response_format", "response_format cannot be combined with tools (the calls have their grammar)")
    fns = [f["function"] for f in t.tools if t.choice in ("auto", "required") or f["function"]["name"] == t.choice]
    think = "<think>" in (getattr(formatter, "source", None) or "")
    prompt = formatter.encode_dialog_prompt(spec.prompts[0]) if think else []
    opened = think and reasoning.prompt_opens_think(formatter.tokenizer, prompt)  # R1's template opens the block
    try:
        spec.params["grammar"] = ToolGrammar.build(t.family, fns, parallel=t.parallel, lazy=t.choice == "auto",
                                                   think=think, opened=opened)
    except ValueError as e:
        raise bad("tools", f"the tools' parameter schemas do not make a grammar: {e}") from None


def call_id(family: str, seed: Optional[int], index: int, k: int) -> str:
    """A call's id, in the family's form (Mistral: 9 letters and digits; else OpenAI's call_...): a function of
    (seed, choice, call) for a seeded request, random otherwise."""
    rng = random.Random(f"{seed}:{index}:{k}") if seed is not None else random.Random(uuid.uuid4().int)
    if family == "mistral":
        return "".join(rng.choice(ID_CHARS) for _ in range(9))
    return "call_" + "".join(rng.choice(ID_CHARS) for _ in range(24))


def calls_of(spec, index: int, text: str) -> Tuple[Optional[str], List[Dict]]:
    """(content, OpenAI tool_calls) of a finished reply."""
    t = spec.tools
    if t is None or not t.calls_allowed:
        return text, []
    content, calls = parse(t.family, text)
    return content, [{"id": call_id(t.family, t.seed, index, k), "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
                     for k, (name, args) in enumerate(calls)]


class ToolStream:
    """One streamed choice: text that cannot begin a call goes out as content at once; from a (possible) trigger
    on it is held, and at the end sent as tool_calls deltas (or as content if it was no call after all)."""

    def __init__(self, spec, index: int):
        self.spec, self.index = spec, index
        self.trigger, self.anchored = TRIGGERS[spec.tools.family]
        self.text, self.sent, self.holding, self.free = "", 0, False, not spec.tools.calls_allowed

    def _delta(self, delta: Dict, finish: Optional[str] = None) -> Dict:
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _safe(self) -> int:
        """How much of the text can go out now."""
        text, trig = self.text, self.trigger
        if self.free:
            return len(text)
        if self.anchored:
            body = text.lstrip()
            if body.startswith(trig) or trig.startswith(body):
                self.holding = body.startswith(trig)
                return self.sent
            self.free = True
            return len(text)
        at = text.find(trig, self.sent)
        if at >= 0:
            self.holding = True
            return at
        for k in range(min(len(trig) - 1, len(text) - self.sent), 0, -1):
            if text.endswith(trig[:k]):
                return len(text) - k
        return len(text)

    def feed(self, delta: str) -> List[Dict]:
        self.text += delta
        if self.holding:
            return []
        end = self._safe()
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return [self._delta({"content": out})] if out else []

    def finish(self, reason: Optional[str]) -> Tuple[List[Dict], Optional[str]]:
        """(the last deltas, the finish_reason)."""
        content, calls = calls_of(self.spec, self.index, self.text)
        if not calls:
            rest = self.text[self.sent:]
            return ([self._delta({"content": rest})] if rest else []), reason
        out = []
        sent = self.text[:self.sent]
        if content and content.startswith(sent) and len(content) > len(sent):
            out.append(self._delta({"content": content[len(sent):]}))
        for k, c in enumerate(calls):
            fn = c["function"]
            out.append(self._delta({"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                                    "function": {"name": fn["name"], "arguments": ""}}]}))
            args = fn["arguments"]
            for s in range(0, len(args), FRAGMENT):
                out.append(self._delta({"tool_calls": [{"index": k, "function": {"arguments": args[s:s + FRAGMENT]}}]}))
        return out, "tool_calls"
