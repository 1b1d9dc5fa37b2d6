"""Grammars for tool calls: the family's call syntax (llama/tokenizers/tool_format.py) with each function's
parameter schema, run by llguidance as structured outputs are (llama/sample/grammar.py).

"required" or a named function: the grammar holds from the reply's first token (after a reasoning block), so the
call always parses and its arguments match the schema. "auto": a lazy grammar, as llama.cpp's server has: the
text is free until the model writes the family's trigger (<tool_call>, {"name", [ or [TOOL_CALLS]); from there
on the call must be well-formed. A trigger inside a <think>...</think> block never counts.
"""

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from llama.sample.grammar import Grammar, Matcher, vocabulary
from llama.tokenizers.tool_format import ARGS_KEY, TRIGGERS

# Compact JSON, as structured outputs write it (llguidance 1.9's masks do not honour custom separators such as
# ", " and ": ": they allow a token its parser then refuses).
JSON_STYLE = {"whitespace_flexible": False}


def object_schema(schema) -> Dict:
    """A function's parameters as JSON schema (Meta's examples write "type": "dict"); an object's unlisted keys are
    refused unless the schema allows them (as OpenAI's strict mode: a small model would otherwise ramble on in
    made-up keys)."""
    if not isinstance(schema, dict):
        return {"type": "object"}
    out = {k: (object_schema(v) if k in ("items", "additionalProperties") and isinstance(v, dict) else v)
           for k, v in schema.items()}
    if out.get("type") == "dict":
        out["type"] = "object"
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: object_schema(v) for k, v in out["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def call_schema(functions: Sequence[Dict], args_key: str) -> Dict:
    """One call object: {"name": one of the functions, args_key: that function's parameters}."""
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 args_key: object_schema(f.get("parameters"))},
                "required": ["name", args_key], "additionalProperties": False} for f in functions]
    return {"anyOf": options, "x-guidance": JSON_STYLE}


def _lit(text: str, specials: Dict[str, int]) -> str:
    """A Lark literal; a special token's text is its token (llguidance's <[id]>), which plain text cannot spell."""
    return f"<[{specials[text]}]>" if text in specials else json.dumps(text)


def _pythonic(functions: Sequence[Dict]) -> str:
    """[f(a=..., b=...)]: each function's required parameters in order, values as JSON (Python reads JSON
    strings, numbers, lists and objects; booleans are written True/False)."""
    rules, names = [], []
    for i, f in enumerate(functions):
        params = object_schema(f.get("parameters"))
        props = params.get("properties") or {}
        parts = []
        for k in params.get("required") or []:
            schema = props.get(k, {})
            value = '("True" | "False")' if schema.get("type") == "boolean" else "%json " + json.dumps(
                {**schema, "x-guidance": JSON_STYLE})
            parts.append(f'{json.dumps(k + "=")} {value}')
        body = ' ", " '.join(parts)
        rules.append(f'fn{i}: {json.dumps(f["name"] + "(")} {body} ")"')
        names.append(f"fn{i}")
    return "pcall: " + " | ".join(names) + "\n" + "\n".join(rules) + "\n"


def calls_lark(family: str, functions: Sequence[Dict], parallel: bool, specials: Dict[str, int],
               think: bool = False) -> str:
    """The Lark grammar of one reply made of calls (one, or several with parallel); think: after an optional
    reasoning block."""
    text = _calls_lark(family, functions, parallel, specials)
    if not think:
        return text
    return text.replace("start:", "start: think_block? calls\nthink_block[lazy]: \"<think>\" THINK_TEXT \"</think>\" "
                        "/\\s*/\nTHINK_TEXT: /(.|\\n)*/\ncalls:", 1)


def _calls_lark(family: str, functions: Sequence[Dict], parallel: bool, specials: Dict[str, int]) -> str:
    more = lambda call, sep: f'{call} ({json.dumps(sep)} {call})*' if parallel else call  # noqa: E731
    if family == "pythonic":
        return f'%llguidance {{}}\nstart: "[" {more("pcall", ", ")} "]"\n' + _pythonic(functions)
    schema = json.dumps(call_schema(functions, ARGS_KEY[family]))
    if family == "llama3_json":
        return f"%llguidance {{}}\nstart: {more('call', '; ')}\ncall: %json {schema}\n"
    if family == "mistral":
        return (f'%llguidance {{}}\nstart: {_lit("[TOOL_CALLS]", specials)} " "? "[" {more("call", ", ")} "]"\n'
                f"call: %json {schema}\n")
    return (f'%llguidance {{}}\nstart: {more("call", chr(10))}\n'
            f'call: {_lit("<tool_call>", specials)} "\\n" %json {schema} "\\n" {_lit("</tool_call>", specials)}\n')


def special_ids(tokenizer) -> Dict[str, int]:
    ids = dict(getattr(tokenizer, "special_ids", None) or {})
    ids.update(getattr(tokenizer, "special_tokens", None) or {})
    return ids


@dataclass(frozen=True)
class ToolGrammar(Grammar):
    """A tool-call grammar: kind "lark", text the grammar with literal triggers (for checking); the matcher
    rebuilds it over the request's tokenizer. lazy: wait for the family's trigger ("auto")."""

    family: str = "generic"
    functions_json: str = "[]"
    parallel: bool = True
    lazy: bool = False
    think: bool = False  # the model may reason in <think>...</think> first
    opened: bool = False  # the prompt opened the block (DeepSeek-R1's template): the reply starts inside it

    @staticmethod
    def build(family: str, functions: Sequence[Dict], parallel: bool = True, lazy: bool = False,
              think: bool = False, opened: bool = False) -> "ToolGrammar":
        fns = json.dumps(list(functions))
        text = calls_lark(family, functions, parallel, {}, think and not lazy)
        return ToolGrammar("lark", text, family=family, functions_json=fns, parallel=parallel, lazy=lazy,
                           think=think, opened=think and opened).checked()

    def matcher(self, tokenizer, stop_tokens) -> "ToolMatcher":
        text = calls_lark(self.family, json.loads(self.functions_json), self.parallel, special_ids(tokenizer),
                          self.think and not self.lazy)
        return ToolMatcher(Grammar("lark", text), tokenizer, stop_tokens, self.family, self.lazy, self.think,
                           self.opened)


class ToolMatcher:
    """The grammar's state for one request, switched on when the call starts: at once (forced) or at the
    trigger (lazy), and in either case only outside a <think> block. Before that it masks nothing."""

    def __init__(self, grammar: Grammar, tokenizer, stop_tokens, family: str, lazy: bool, think: bool,
                 opened: bool = False):
        self.grammar, self.tokenizer, self.stop_tokens = grammar, tokenizer, stop_tokens
        self.trigger, self.anchored = TRIGGERS[family]
        self.lazy, self.think = lazy, think
        self.prefix = "<think>" if opened else ""  # read the reply as if it had opened the block itself
        self.tokens: List[int] = []
        self.start = 0  # where the text after any reasoning block begins
        self.free = False  # an anchored trigger can no longer come: the reply is plain text
        self.active: Optional[Matcher] = None if lazy else self._matcher()

    def _matcher(self) -> Matcher:
        return Matcher(self.grammar, vocabulary(self.tokenizer), self.stop_tokens)

    def mask(self, row) -> None:
        if self.active is not None:
            self.active.mask(row)

    def consume(self, token: int) -> bool:
        if self.active is not None:
            return self.active.consume(token)
        self.tokens.append(token)
        if self.free:
            return False
        text = self.prefix + self.tokenizer.decode(self.tokens)
        if self.think:
            head = text.lstrip()
            if head.startswith("<think>"):
                end = text.find("</think>")
                if end < 0:
                    return False
                self.start = end + len("</think>")
            elif "<think>".startswith(head):  # may still open a reasoning block
                return False
        rest = text[self.start:]
        at = self._trigger_at(rest)
        return False if at is None else self._switch_on(text, self.start + at)

    def _trigger_at(self, rest: str) -> Optional[int]:
        if self.anchored:
            body = rest.lstrip()
            if body.startswith(self.trigger):
                return len(rest) - len(body)
            if not self.trigger.startswith(body):
                self.free = True
            return None
        at = rest.find(self.trigger)
        return None if at < 0 else at

    def _switch_on(self, text: str, at: int) -> bool:
        """Start the grammar and feed it the reply from the call's first character: the tokens themselves when
        they start there (a special-token trigger must stay one token), else that text re-tokenized (llguidance
        matches bytes, so any spelling of them is accepted)."""
        self.active = self._matcher()
        text, at = text[len(self.prefix):], at - len(self.prefix)  # the reply's own text
        tail = None
        for k in range(len(self.tokens), -1, -1):
            n = len(self.tokenizer.decode(self.tokens[:k]))
            if n <= at:
                tail = self.tokens[k:] if n == at else None
                break
        if tail is None:
            tail = self.active.vocab.lltok.tokenize_str(text[at:])
        done = False
        for t in tail:
            done = self.active.consume(t)
        return done
