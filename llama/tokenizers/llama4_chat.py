"""Llama 4's chat format, token for token as llama-models' llama4 ChatFormat builds it, and its reading of a
reply into tool calls (decode_assistant_message).

<|begin_of_text|>, then per message <|header_start|>role<|header_end|>\\n\\n + content (+ an assistant's tool calls,
written as llama-models' ToolUtils writes them) + <|eot|>, then the assistant header. Unlike Llama 3's, a tool
result (role "tool", header "ipython") and an assistant message that calls tools end in <|eom|>, no tag marks
a call, and special-token text in content is always plain text. Image content is refused (messages.NO_VISION).

Tools (a ToolDialog from llama/tokenizers/tool_format.py) are offered in the system message as Meta's tool
syntax writes them: `pythonic` by default (the [f(a=1)] call list with llama-models' Llama 3.2 system text: 0.3.0
ships no Llama 4 tool prompt), or `llama3_json` (Llama 3.1's system text and custom-tools message).
"""

from typing import Dict, List, Optional, Tuple

from llama.tokenizers.header_format import HeaderChatFormat
from llama.tokenizers.tool_format import BUILTINS, call_text, meta_system_text, meta_tools_message, parse

EOM_REASONS = ("eom", "end_of_message")  # an assistant message's stop_reason that ends it in <|eom|>


class Llama4ChatFormat(HeaderChatFormat):
    """The chat-format interface (see chat_format.py) for a Llama 4 tokenizer; tool_style: the tool syntax,
    "pythonic" or "llama3_json"."""

    HEADER = ("<|header_start|>", "<|header_end|>")

    def __init__(self, tokenizer, tool_style: str = "pythonic"):
        super().__init__(tokenizer, tool_style)
        self.possible_headers = {r: f"<|header_start|>{'ipython' if r == 'tool' else r}<|header_end|>\n\n"
                                 for r in ("user", "system", "tool", "assistant")}  # llama-models' name

    _encode_header = HeaderChatFormat.encode_header  # llama-models' name

    def encode_message(self, message: Dict, family: Optional[str] = None) -> List[int]:
        """One message: header, content, an assistant's tool_calls ([{"name", "arguments"}]) in `family`'s syntax
        (default: this format's), then <|eom|> for a tool result, a message with calls or one whose stop_reason
        is "eom", else <|eot|>."""
        role, calls = message["role"], message.get("tool_calls") or []
        tokens = self.encode_header(role) + self.tokenizer.encode(message["content"], bos=False, eos=False)
        if role == "assistant":
            for call in calls:
                tokens += self.tokenizer.encode(call_text(family or self.tool_style, call), bos=False, eos=False)
        eom = role in ("tool", "ipython") or (role == "assistant" and (bool(calls)
                                                                        or message.get("stop_reason") in EOM_REASONS))
        return tokens + [self.special["<|eom|>" if eom else "<|eot|>"]]

    def encode_dialog_prompt(self, dialog) -> List[int]:
        self.validate(dialog)
        if hasattr(dialog, "render_with"):
            return dialog.render_with(self)
        tokens = [self.special["<|begin_of_text|>"]]
        for message in dialog:
            tokens += self.encode_message(message)
        return tokens + self.encode_header("assistant")

    def encode_tool_dialog(self, dialog) -> List[int]:
        """A ToolDialog: the tools in the system message (with the dialog's own system text after them), for
        llama3_json the custom tools in a user message after it, then the messages as encode_message writes them."""
        family = dialog.family if dialog.family in ("pythonic", "llama3_json") else self.tool_style
        messages = list(dialog)
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        if system is not None:
            messages = messages[1:]
        tokens = [self.special["<|begin_of_text|>"]]
        if dialog.tools:
            tokens += self.encode_message({"role": "system",
                                           "content": meta_system_text(family, dialog.tools, system, dialog.today)})
            listed = meta_tools_message(family, dialog.tools)
            if listed:
                tokens += self.encode_message({"role": "user", "content": listed})
        elif system is not None:
            tokens += self.encode_message({"role": "system", "content": system})
        for m in messages:
            tokens += self.encode_message(m, family)
        return tokens + self.encode_header("assistant")

    def decode_assistant_message(self, tokens: List[int], stop_reason: Optional[str] = None) -> Dict:
        """A reply's tokens as a message, as llama-models' decode_assistant_message reads them."""
        return self.decode_assistant_message_from_content(self.tokenizer.decode(tokens), stop_reason)

    def decode_assistant_message_from_content(self, content: str, stop_reason: Optional[str] = None) -> Dict:
        """{"role": "assistant", "content", "stop_reason", "tool_calls": [{"name", "arguments"}]}: the header, a
        <|python_start|>..<|python_end|> wrapper and a final <|eot|>/<|eom|> (which sets stop_reason "eot"/"eom")
        come off; a call is read in either Meta syntax (JSON or [f(a=1)] list), as a built-in's
        name.call(query="..."), or, after <|python_start|>, as code_interpreter's code. Content is "" when
        there are calls. Unlike llama-models, every call of a list is kept (it keeps the first)."""
        content, stop_reason = strip_reply(content.strip(" "), self.possible_headers["assistant"], stop_reason)
        ipython = content.startswith("<|python_start|>")
        if ipython:
            content = content[len("<|python_start|>"):].replace("<|python_end|>", "")
        calls = reply_calls(content, ipython)
        return {"role": "assistant", "content": "" if calls else content, "stop_reason": stop_reason,
                "tool_calls": [{"name": name, "arguments": args} for name, args in calls]}


def strip_reply(content: str, header: str, stop_reason: Optional[str]) -> Tuple[str, Optional[str]]:
    if content.startswith(header):
        content = content[len(header):]
    for tag, reason in (("<|eot|>", "eot"), ("<|eom|>", "eom")):
        if content.endswith(tag):
            return content[:-len(tag)], reason
    return content, stop_reason


def reply_calls(content: str, ipython: bool) -> List[Tuple[str, Dict]]:
    """The calls of a reply's text: JSON ({"name", "parameters"}) or a [f(a=1)] list, a built-in's call text, or
    (ipython) the code of a code_interpreter call; a custom call naming a built-in takes its first value as the
    query, as llama-models reads it."""
    _, calls = parse("llama3_json", content)
    if not calls and ipython and content.strip():
        calls = [("code_interpreter", {"code": content})]
    return [(name, {"query": next(iter(args.values()))}) if name in BUILTINS[:3] and args and "query" not in args
            else (name, args) for name, args in calls]
