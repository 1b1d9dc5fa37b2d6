"""Tool calling in the prompt and in the reply: how a dialog with tools, tool calls and tool results becomes
prompt tokens, and how a reply's text becomes tool calls, one family at a time.

Families (`family_of(formatter)`):
  llama3_json  Meta's Llama 3.1: Environment: ipython, the built-ins and the date in the system prompt, custom
               tools in a user message after it (llama-models' own prompt templates), calls as {"name": ...,
               "parameters": ...}, built-ins (brave_search, wolfram_alpha, photogen, code_interpreter) after
               <|python_tag|>, results as ipython; a Meta checkpoint renders as llama-models'
               ChatFormat(tool_prompt_format=json) does.
  pythonic     Meta's Llama 3.2/3.3: calls as a Python list [f(a=1), g(b="x")] (tool_prompt_format=python_list).
               Llama 4 speaks either Meta family (pythonic by default; its format renders its own dialogs,
               llama4_chat.py), and may wrap a reply in <|python_start|>..<|python_end|>.
  hermes       <tool_call>{"name": ..., "arguments": ...}</tool_call> (Hermes, Qwen 2.5), the template's own text.
  mistral      [TOOL_CALLS][{"name": ..., "arguments": ...}], 9-character call ids.
  generic      a template without tools (SmolLM2) or Llama 2: our tool prompt in the system message and the hermes
               tag syntax, enforced by a grammar (llama/sample/tool_grammar.py), as llama.cpp's server does.

A call here is {"id": str, "name": str, "arguments": dict}. `ToolDialog` is a dialog (a list of messages) that
carries its tools: a chat format encodes it through `render_with(format)` (duck-typed, so chat_format need not
import this module).
"""

import ast
import json
import re
from datetime import datetime
from typing import Dict, List, Optional, Sequence, Tuple

from llama.tokenizers.messages import validate_messages, with_template_kwargs

BUILTINS = ("brave_search", "wolfram_alpha", "photogen", "code_interpreter")
FAMILIES = ("llama3_json", "pythonic", "hermes", "mistral", "generic")
# family -> (trigger text that starts a call, whether it counts only at the start of the reply)
TRIGGERS = {"llama3_json": ('{"name"', True), "pythonic": ("[", True), "hermes": ("<tool_call>", False),
            "mistral": ("[TOOL_CALLS]", True), "generic": ("<tool_call>", False)}
ARGS_KEY = {"llama3_json": "parameters", "hermes": "arguments", "mistral": "arguments", "generic": "arguments"}

GENERIC_PROMPT = (
    "You can call tools (functions) to help answer. The available tools, as JSON:\n{tools}\n\n"
    "To call a tool, reply with one <tool_call></tool_call> block per call, each holding a JSON object with the "
    "tool's \"name\" and its \"arguments\", for example:\n<tool_call>\n{{\"name\": \"tool_name\", \"arguments\": "
    "{{\"argument\": \"value\"}}}}\n</tool_call>\nEach result comes back in a <tool_response></tool_response> "
    "block. When no tool is needed, answer directly.")
# Llama 3.1's tool prompt as llama-models' own templates write it: llama3/prompt_templates/system_prompts.py
# (SystemDefaultGenerator, BuiltinToolGenerator, JsonCustomToolGenerator) joined by llama3/api/interface.py's
# LLama31Interface.system_messages. llama-models moved them to llama-stack (models/llama/llama3/prompt_templates);
# 0.3.0 ships what they wrote, llama_models/llama3_1/prompt_format.md, which the tests compare with.
LLAMA31_DATE = "Cutting Knowledge Date: December 2023\nToday Date: {today}"
LLAMA31_TOOLS = ("Answer the user's question by making use of the following functions if needed.\n"
                 "If none of the function can be used, please say so.\nHere is a list of functions in JSON format:\n")
LLAMA31_TOOLS_END = "\nReturn function calls in JSON format."
LLAMA32_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the function can be used, point it out. If the given question lacks the parameters required by "
    "the function,\nalso point it out. You should only return the function call in tools call sections.\n\n"
    "If you decide to invoke any of the function(s), you MUST put it in the format of [func_name1(params_name1="
    "params_value1, params_name2=params_value2...), func_name2(params)]\nYou SHOULD NOT include any other text in "
    "the response.\n\nHere is a list of functions in JSON format that you can invoke.\n\n")


class ToolDialog(list):
    """Messages plus the tools offered (OpenAI's [{"type": "function", "function": {...}}]) and the family whose
    syntax renders them. Messages may carry tool_calls ([{"id", "name", "arguments": dict}]) and tool_call_id."""

    def __init__(self, messages, tools: Sequence[Dict], family: str, today: Optional[str] = None,
                 template_kwargs: Optional[Dict] = None):
        """today: the date Llama 3.1's system prompt states ("21 September 2024"); None: the day it is rendered.
        template_kwargs: extra variables of a Jinja template (chat_format.with_template_kwargs); by default
        those messages carry."""
        super().__init__(messages)
        self.tools, self.family, self.today = list(tools), family, today
        self.template_kwargs = dict(getattr(messages, "template_kwargs", {}) if template_kwargs is None
                                    else template_kwargs)

    def validate_with(self, fmt, index: int = 0) -> None:
        validate_messages([{"role": m["role"], "content": m["content"]} for m in self], index,
                          ("system", "user", "assistant", "tool", "ipython"))
        if self[-1]["role"] == "assistant":
            raise ValueError(f"dialog {index}: the last message must not be the assistant's (the reply comes next)")

    def render_with(self, fmt) -> List[int]:
        return encode(fmt, self)


def family_of(fmt) -> str:
    """The tool syntax a chat format speaks: its template's own, Meta's for Llama 3, else the generic one."""
    template = getattr(fmt, "source", None)
    if template is not None:
        if "tools" not in template:
            return "generic"
        if "<tool_call>" in template:
            return "hermes"
        if "[TOOL_CALLS]" in template:
            return "mistral"
        if "<|start_header_id|>" in template:
            return "pythonic" if "func_name1(" in template else "llama3_json"
        return "generic"
    if hasattr(fmt, "encode_header"):  # Meta's Llama 3 format
        return getattr(fmt, "tool_style", "llama3_json")
    return "generic"


def functions(tools: Sequence[Dict]) -> List[Dict]:
    return [t["function"] for t in tools]


# ------------------------------------------------------------------------------------------------ rendering
def encode(fmt, dialog: ToolDialog) -> List[int]:
    """The prompt tokens of a tool dialog in fmt's family (Llama 4's format renders its own)."""
    if hasattr(fmt, "encode_tool_dialog"):
        return fmt.encode_tool_dialog(dialog)
    if dialog.family in ("llama3_json", "pythonic") and hasattr(fmt, "encode_header"):
        return meta_llama3_tokens(fmt, dialog, dialog.family)
    if dialog.family == "generic":
        return fmt.encode_dialog_prompt(with_template_kwargs(generic_messages(dialog), dialog.template_kwargs))
    return fmt.tokenizer.encode(fmt.render(template_messages(dialog), tools=dialog.tools or None,
                                           template_kwargs=dialog.template_kwargs), bos=False, eos=False)


def template_messages(dialog: Sequence[Dict]) -> List[Dict]:
    """Messages as templates read them (OpenAI's shape, with arguments as objects, as vLLM passes them)."""
    out = []
    for m in dialog:
        msg = {k: v for k, v in m.items() if k != "tool_calls"}
        if m.get("tool_calls"):
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in m["tool_calls"]]
        out.append(msg)
    return out


def call_text(family: str, call: Dict) -> str:
    """One call as the model writes it (Meta's ToolUtils.encode_tool_call for the Llama 3 families)."""
    name, args = call["name"], call["arguments"]
    if family in ("llama3_json", "pythonic") and name in BUILTINS[:3]:
        return f'{name}.call(query="{args.get("query", "")}")'
    if family in ("llama3_json", "pythonic") and name == "code_interpreter":
        return args.get("code", "")
    if family == "llama3_json":
        return json.dumps({"type": "function", "name": name, "parameters": args})
    if family == "pythonic":
        return f"[{name}({', '.join(f'{k}={_py(v)}' for k, v in args.items())})]"
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def _py(value) -> str:
    """llama-models' format_value (python_list)."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (int, float, bool)) or value is None:
        return str(value)
    if isinstance(value, list):
        return f"[{', '.join(_py(v) for v in value)}]"
    if isinstance(value, dict):
        return f"{{{', '.join(f'{k}={_py(v)}' for k, v in value.items())}}}"
    raise ValueError(f"a tool call argument of type {type(value).__name__} cannot be written as a Python literal")


def meta_system_text(family: str, tools: Sequence[Dict], system: Optional[str], today: Optional[str] = None) -> str:
    """The system message of a Meta Llama 3 tool dialog. 3.1: as LLama31Interface.system_messages writes it
    (code_interpreter needs no Tools line: Environment: ipython turns it on); today: "%d %B %Y", None for now."""
    fns = functions(tools)
    if family == "pythonic":
        text = LLAMA32_PROMPT + json.dumps([f for f in fns if f["name"] not in BUILTINS], indent=4)
        return text + ("\n\n" + system if system else "")
    text = ""
    if fns:
        shown = [f["name"] for f in fns if f["name"] in BUILTINS and f["name"] != "code_interpreter"]
        text = "Environment: ipython\n" + ("Tools: " + ", ".join(shown) if shown else "") + "\n"
    text += LLAMA31_DATE.format(today=today or datetime.now().strftime("%d %B %Y"))
    return text + ("\n\n" + system if system else "") + "\n"


def meta_tools_message(family: str, tools: Sequence[Dict]) -> Optional[str]:
    """Llama 3.1's custom tools, the user message llama-models puts after the system message
    (JsonCustomToolGenerator), or None. Deliberately unlike it: that template takes llama-models'
    ToolParamDefinition and lists each parameter as {"name": {"type": "object", "description": ...}}, dropping
    its type; an OpenAI tool's parameters are a JSON schema, written here as given (the model then sees the
    types, enums and nesting its grammar enforces). Text is JSON-escaped where the template pastes it raw."""
    custom = [f for f in functions(tools) if f["name"] not in BUILTINS]
    if family != "llama3_json" or not custom:
        return None
    listed = [{"type": "function", "function": {k: f[k] for k in ("name", "description", "parameters") if k in f}}
              for f in custom]
    return LLAMA31_TOOLS + "".join(_meta_json(t) + "\n" for t in listed) + LLAMA31_TOOLS_END


def _meta_json(value, depth: int = 0) -> str:
    """JSON in the layout JsonCustomToolGenerator writes by hand: 4-space indents, a list of plain values on one
    line ("required": ["n"]), non-ASCII text as is."""
    pad = "    " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {_meta_json(v, depth + 1)}" for k, v in value.items()]
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        items = [pad + _meta_json(v, depth + 1) for v in value]
    else:
        return json.dumps(value, ensure_ascii=False)
    opening, closing = "{}" if isinstance(value, dict) else "[]"
    return opening + "\n" + ",\n".join(items) + "\n" + "    " * depth + closing


def meta_llama3_tokens(fmt, dialog: ToolDialog, family: str) -> List[int]:
    """As llama-models' ChatFormat.encode_dialog_prompt: an assistant message's calls after its content
    (<|python_tag|> first when the first is code_interpreter, <|eom_id|> when its calls are built-ins), tool
    results under the ipython header; the tool definitions lead the dialog (meta_system_text, meta_tools_message)."""
    special, tok = fmt.special, fmt.tokenizer
    messages = list(dialog)
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    if system is not None:
        messages = messages[1:]
    tokens = [special["<|begin_of_text|>"]]
    tokens += fmt.encode_message({"role": "system",
                                  "content": meta_system_text(family, dialog.tools, system, dialog.today)})
    listed = meta_tools_message(family, dialog.tools)
    if listed:
        tokens += fmt.encode_message({"role": "user", "content": listed})
    for m in messages:
        calls = m.get("tool_calls") or []
        if m["role"] != "assistant" or not calls:
            tokens += fmt.encode_message({"role": m["role"], "content": m["content"]})
            continue
        tokens += fmt.encode_header("assistant")
        if calls[0]["name"] == "code_interpreter":
            tokens.append(special["<|python_tag|>"])
        for text in [m["content"]] + [call_text(family, c) for c in calls]:
            tokens += tok.encode(text, bos=False, eos=False)
        builtin = all(c["name"] in BUILTINS for c in calls)
        tokens.append(special["<|eom_id|>" if builtin else "<|eot_id|>"])
    return tokens + fmt.encode_header("assistant")


def generic_messages(dialog: ToolDialog) -> List[Dict]:
    """The dialog as plain messages for a format without tools: our tool prompt leads the system message, calls
    are written in <tool_call> tags, results become user messages in <tool_response> tags (merged with a
    neighbouring user message, so Llama 2's user/assistant alternation holds)."""
    prompt = GENERIC_PROMPT.format(tools=json.dumps(functions(dialog.tools), indent=2)) if dialog.tools else ""
    out: List[Dict] = []
    for m in dialog:
        role, content = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            content = "\n".join(([content] if content else []) + [call_text("generic", c) for c in m["tool_calls"]])
        if role in ("tool", "ipython"):
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if out and role == "user" and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + content}
        else:
            out.append({"role": role, "content": content})
    if prompt:
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": prompt + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ------------------------------------------------------------------------------------------------ parsing
def parse(family: str, text: str) -> Tuple[Optional[str], List[Tuple[str, Dict]]]:
    """(content, [(name, arguments)]) of a reply; text that is not a well-formed call stays content."""
    calls: List[Tuple[str, Dict]] = []
    if family in ("hermes", "generic"):
        pattern = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
        rest, pos = [], 0
        for m in pattern.finditer(text):
            call = _json_call(m.group(1), "arguments")
            if call is None:
                continue
            calls.append(call)
            rest.append(text[pos:m.start()])
            pos = m.end()
        content = ("".join(rest) + text[pos:]).strip() if calls else text
        return (content or None), calls
    body = text.strip()
    if family == "mistral":
        if body.startswith("[TOOL_CALLS]"):
            body = body[len("[TOOL_CALLS]"):].strip()
        try:
            items = json.loads(body)
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [c for c in (_call(i, "arguments") for i in items) if c is not None]
        return (None, calls) if calls and len(calls) == len(items) else (text, [])
    tagged = body.startswith("<|python_tag|>")
    body = body[len("<|python_tag|>"):].strip() if tagged else body
    if body.startswith("<|python_start|>"):  # Llama 4's wrapper of a call or of code_interpreter's code
        tagged, body = True, body[len("<|python_start|>"):].replace("<|python_end|>", "").strip()
    calls = _python_calls(body) if family == "pythonic" else _json_calls(body, "parameters")
    if not calls and family == "llama3_json":
        calls = _python_calls(body)
    if not calls:
        m = re.fullmatch(r'(brave_search|wolfram_alpha|photogen)\.call\(query="(.*)"\)', body, re.S)
        if m:
            calls = [(m.group(1), {"query": m.group(2)})]
        elif tagged:
            calls = [("code_interpreter", {"code": body})]
    return (None, calls) if calls else (text, [])


def _call(obj, key: str) -> Optional[Tuple[str, Dict]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _json_call(text: str, key: str) -> Optional[Tuple[str, Dict]]:
    try:
        return _call(json.loads(text), key)
    except ValueError:
        return None


def _json_calls(text: str, key: str) -> List[Tuple[str, Dict]]:
    """One or more JSON call objects separated by ';' or whitespace (Llama 3.1's format); [] unless all parse."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            return []
        call = _call(obj, key)
        if call is None:
            return []
        calls.append(call)
        pos = end
        while pos < len(text) and text[pos] in "; \n\t":
            pos += 1
    return calls


_LITERALS = {"true": True, "false": False, "null": None}


def _literal(node):
    if isinstance(node, ast.Name) and node.id in _LITERALS:  # JSON spellings, as a grammar may write them
        return _LITERALS[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _python_calls(text: str) -> List[Tuple[str, Dict]]:
    """Llama 3.2's [f(a=1), g(b="x")]; [] unless the whole text is such a list."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return []
    node = tree.body
    if not isinstance(node, ast.List) or not node.elts:
        return []
    calls = []
    for e in node.elts:
        if not isinstance(e, ast.Call) or not isinstance(e.func, ast.Name) or e.args:
            return []
        try:
            calls.append((e.func.id, {k.arg: _literal(k.value) for k in e.keywords}))
        except (ValueError, TypeError):
            return []
    return calls
