"""Chat formats: turning a dialog into prompt tokens, one interface for every model family: Meta's Llama 2 and
Llama 3 formats token for token (Llama 4's is llama4_chat.py), and a model's own Jinja template (GGUF, Hugging
Face), rendered as Hugging Face renders it.

A chat format offers validate(dialog, index), encode_dialog_prompt(dialog) -> token ids, refusal(dialog) (the
answer to give instead of running a dialog the format forbids, or None), strip_reply_space (drop the reply's
first space, which the template puts after its last tag) and stop_tokens ({id: finish_reason}, added to the
tokenizer's for chat replies). `chat_format_for(tokenizer)` picks the format that belongs to a tokenizer.

A template's own switches (Qwen3's enable_thinking) travel with the dialog: `with_template_kwargs(dialog,
kwargs)` (a `TemplateDialog`) passes them to the template as extra variables, as transformers' and vLLM's
chat_template_kwargs do; formats without a template read none of them.
"""

import datetime
import json
from typing import Dict, List, Literal, Optional, Sequence, TypedDict

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llama.tokenizers.header_format import HeaderChatFormat
from llama.tokenizers.llama4_chat import Llama4ChatFormat
from llama.tokenizers.messages import TemplateDialog, validate_messages, with_template_kwargs  # noqa: F401 (kept here)

Role = Literal["system", "user", "assistant", "ipython", "tool"]


class Message(TypedDict):
    role: Role
    content: str


Dialog = Sequence[Message]

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
SPECIAL_TAGS = [B_INST, E_INST, "<<SYS>>", "<</SYS>>"]
UNSAFE_ERROR = "Error: special tags are not allowed as part of the prompt."


def validate_dialog(dialog, index: int = 0) -> None:
    """The Llama 2 rules: known roles, an optional system message, then user/assistant alternating, user last."""
    validate_messages(dialog, index)
    where = f"dialog {index}"
    turns = dialog[1:] if dialog[0]["role"] == "system" else dialog
    if not turns:
        raise ValueError(f"{where}: a system message must be followed by a user message")
    for i, msg in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if msg["role"] != expected:
            offset = len(dialog) - len(turns)
            raise ValueError(
                f"{where}, message {i + offset}: expected role {expected!r}, got {msg['role']!r} "
                "(after an optional system message, roles must alternate user, assistant, user, ...)"
            )
    if turns[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message must be from the user, got {turns[-1]['role']!r}")


def has_special_tags(dialog: Dialog) -> bool:
    return any(tag in msg["content"] for tag in SPECIAL_TAGS for msg in dialog)


class ChatFormat:
    """The Llama 2 chat template, token for token as Meta's reference builds it. Meta's `ChatFormat(tokenizer)`
    is Llama 3's (llama3's llama/tokenizer.py), so given a Llama 3 tokenizer it returns a Llama3ChatFormat, and
    given a Llama 4 one a Llama4ChatFormat (llama4_chat.py)."""

    strip_reply_space = True  # the reply follows "[/INST]" and starts with the template's separator space
    stop_tokens: Dict[int, str] = {}

    def __new__(cls, tokenizer=None):  # None: copy and pickle make the object without arguments
        if cls is ChatFormat and "<|start_header_id|>" in getattr(tokenizer, "special_tokens", {}):
            return Llama3ChatFormat(tokenizer)
        if cls is ChatFormat and "<|header_start|>" in getattr(tokenizer, "special_tokens", {}):
            return Llama4ChatFormat(tokenizer)
        return super().__new__(cls)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def validate(self, dialog, index: int = 0) -> None:
        if hasattr(dialog, "render_with"):  # a dialog with tools (llama/tokenizers/tool_format.py)
            return dialog.validate_with(self, index)
        validate_dialog(dialog, index)

    def refusal(self, dialog: Dialog) -> Optional[str]:
        """The reference answers a dialog containing the template's own tags with this error text."""
        return UNSAFE_ERROR if has_special_tags(dialog) else None

    def fold_system(self, dialog: Dialog) -> List[Message]:
        """Fold a leading system message into the first user message, as the reference does."""
        if dialog[0]["role"] != "system":
            return [dict(m) for m in dialog]
        first = dialog[1]
        content = B_SYS + dialog[0]["content"] + E_SYS + first["content"]
        return [{"role": first["role"], "content": content}] + [dict(m) for m in dialog[2:]]

    def encode_turn(self, user: str, assistant: str) -> List[int]:
        """A completed exchange: BOS [INST] user [/INST] assistant EOS."""
        return self.tokenizer.encode(f"{B_INST} {user.strip()} {E_INST} {assistant.strip()} ", bos=True, eos=True)

    def encode_prompt_turn(self, user: str) -> List[int]:
        """The final user message, awaiting the reply: BOS [INST] user [/INST]."""
        return self.tokenizer.encode(f"{B_INST} {user.strip()} {E_INST}", bos=True, eos=False)

    def encode_dialog_prompt(self, dialog: Dialog) -> List[int]:
        if hasattr(dialog, "render_with"):
            return dialog.render_with(self)
        validate_dialog(dialog)
        msgs = self.fold_system(dialog)
        tokens: List[int] = []
        for prompt, answer in zip(msgs[::2], msgs[1::2]):
            tokens += self.encode_turn(prompt["content"], answer["content"])
        return tokens + self.encode_prompt_turn(msgs[-1]["content"])


class Llama3ChatFormat(HeaderChatFormat):
    """Llama 3.x's header format, token for token as Meta's llama-models builds it:
    <|begin_of_text|>, then per message <|start_header_id|>role<|end_header_id|>\n\n content <|eot_id|>, then the
    assistant header. Content is kept as given (llama-models; the original llama3 code and Hugging Face's template
    strip it). Role "tool" is an alias of "ipython" (a tool's output). An assistant message whose content starts
    with "<|python_tag|>" is a built-in tool call: the tag is its special token and the message ends in <|eom_id|>,
    as the model wrote it."""

    HEADER = ("<|start_header_id|>", "<|end_header_id|>")

    def __init__(self, tokenizer, tool_style: str = "llama3_json"):
        super().__init__(tokenizer, tool_style)

    def encode_message(self, message: Message) -> List[int]:
        tokens, content, end = self.encode_header(message["role"]), message["content"], "<|eot_id|>"
        if message["role"] == "assistant" and content.startswith("<|python_tag|>"):
            tokens.append(self.special["<|python_tag|>"])
            content, end = content[len("<|python_tag|>"):], "<|eom_id|>"
        return tokens + self.tokenizer.encode(content, bos=False, eos=False) + [self.special[end]]

    def encode_dialog_prompt(self, dialog: Dialog) -> List[int]:
        self.validate(dialog)
        if hasattr(dialog, "render_with"):
            return dialog.render_with(self)
        tokens = [self.special["<|begin_of_text|>"]]
        for message in dialog:
            tokens += self.encode_message(message)
        return tokens + self.encode_header("assistant")


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _raise(message):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Hugging Face's tojson (Jinja's own escapes HTML characters and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def template_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment Hugging Face renders chat templates in (transformers' chat_template_utils)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


# Variables the renderer sets itself (or that name the template and its tokenizing, refused by vLLM too).
TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "chat_template",
                     "tokenize")
TEMPLATE_KWARG_TYPES = {"enable_thinking": bool}  # switches real templates test with `is false`/`is true`


def _json_value(v) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_json_value(x) for x in v)
    return isinstance(v, dict) and all(isinstance(k, str) and _json_value(x) for k, x in v.items())


def template_kwarg_problem(key, value) -> Optional[str]:
    """Why one chat_template_kwargs entry cannot go to a template (None: it can). Unknown keys pass through, as
    vLLM passes them; a template that does not read one ignores it."""
    if not isinstance(key, str):
        return f"keys must be strings, got {key!r}"
    if key in TEMPLATE_RESERVED:
        return f"{key!r} is set by the chat format itself (reserved: {', '.join(TEMPLATE_RESERVED)})"
    want = TEMPLATE_KWARG_TYPES.get(key)
    if want is bool and not isinstance(value, bool):
        return f"{key!r} must be true or false, got {value!r}"
    if not _json_value(value):
        return f"{key!r} must be a JSON value (null, bool, number, string, list or object), got {type(value).__name__}"
    return None


def check_template_kwargs(kwargs, name: str = "chat_template_kwargs") -> Dict:
    """kwargs as a dict for the template ({} for None); TypeError unless a dict, ValueError naming a bad entry."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise TypeError(f"{name} must be a dict of template variables (e.g. {{'enable_thinking': False}}), got "
                        f"{type(kwargs).__name__}")
    for key, value in kwargs.items():
        problem = template_kwarg_problem(key, value)
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
    return dict(kwargs)


class TemplateChatFormat:
    """The chat-format interface over a Jinja template; its end-of-turn token stops replies."""

    strip_reply_space = False
    ROLES = ("system", "user", "assistant", "tool", "ipython")

    def __init__(self, tokenizer, template: str):
        env = template_environment()
        self.source = template
        try:
            self.template = env.from_string(template)
        except TemplateError as e:
            raise ValueError(f"the chat template of {getattr(tokenizer, 'source', 'the tokenizer')} does not "
                             f"compile: {e}") from None
        self.tokenizer = tokenizer
        special = getattr(tokenizer, "special_ids", {})
        self.stop_tokens: Dict[int, str] = {special[t]: "eot" for t in END_OF_TURN
                                            if t in special and t in template and special[t] != tokenizer.eos_id}

    def validate(self, dialog, index: int = 0) -> None:
        if hasattr(dialog, "render_with"):
            return dialog.validate_with(self, index)
        validate_messages(dialog, index, self.ROLES)
        if dialog[-1]["role"] == "assistant":
            raise ValueError(f"dialog {index}: the last message must not be the assistant's (the reply comes next)")

    def refusal(self, dialog: Dialog) -> Optional[str]:
        return None

    def render(self, dialog: Dialog, tools: Optional[List[Dict]] = None, template_kwargs: Optional[Dict] = None) -> str:
        """The prompt text; template_kwargs (default: the dialog's own, see with_template_kwargs) are extra
        variables such as Qwen3's enable_thinking."""
        tok = self.tokenizer
        piece = lambda i: tok.piece(i) if i is not None and i >= 0 else ""  # noqa: E731
        extra = check_template_kwargs(getattr(dialog, "template_kwargs", None) if template_kwargs is None
                                      else template_kwargs)
        if tools is not None:  # as transformers: unset without tools
            extra["tools"] = tools
        try:
            return self.template.render(messages=[dict(m) for m in dialog], add_generation_prompt=True,
                                        bos_token=piece(tok.bos_id), eos_token=piece(tok.eos_id), **extra)
        except TemplateError as e:
            raise ValueError(f"the chat template refused the dialog: {e}") from None

    def encode_dialog_prompt(self, dialog: Dialog) -> List[int]:
        self.validate(dialog)
        if hasattr(dialog, "render_with"):
            return dialog.render_with(self)
        return self.tokenizer.encode(self.render(dialog), bos=False, eos=False)


TOOL_STYLES = ("llama3_json", "pythonic")


def meta_tool_style(params) -> str:
    """The tool-call syntax Meta's stack uses for a Llama 3 checkpoint of this shape: the pythonic call list for the
    3.2 text models (1B: dim 2048, 3B: dim 3072, both with scaled rope), JSON for 3.1. Llama 3.3 70B has 3.1 70B's
    shape, so it gets JSON unless told (Llama(..., tool_style="pythonic"), --tool-style)."""
    small = getattr(params, "dim", None) in (2048, 3072) and getattr(params, "use_scaled_rope", False)
    return "pythonic" if small and getattr(params, "vocab_size", None) == 128256 else "llama3_json"


def chat_format_for(tokenizer, params=None, tool_style: Optional[str] = None):
    """The chat format that belongs to a tokenizer (the family is decided by the tokenizer, not by a flag): the
    model's own Jinja template when it carries one, else Meta's Llama 4 (pythonic tool calls unless tool_style names
    the other syntax), Llama 3 (tool syntax by `params`' shape unless tool_style names one) or Llama 2 format."""
    if tool_style is not None and tool_style not in TOOL_STYLES:
        raise ValueError(f"tool_style must be one of {TOOL_STYLES} or None, got {tool_style!r}")
    if getattr(tokenizer, "chat_template", None):
        return TemplateChatFormat(tokenizer, tokenizer.chat_template)
    if "<|start_header_id|>" in getattr(tokenizer, "special_tokens", {}):
        return Llama3ChatFormat(tokenizer, tool_style or meta_tool_style(params))
    if "<|header_start|>" in getattr(tokenizer, "special_tokens", {}):
        return Llama4ChatFormat(tokenizer, tool_style or "pythonic")
    return ChatFormat(tokenizer)
