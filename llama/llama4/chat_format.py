"""llama-models' `llama_models.llama4.chat_format` names, for code written against it: `ChatFormat(tokenizer,
vision_args=None, max_num_chunks=16)` with Meta's `encode_dialog_prompt(messages, tool_prompt_format)` (messages
as llama-models' RawMessage objects or as dicts; the result has `.tokens`, and `.images` None), `encode_message`,
`_encode_header`, `encode_content(content)` (a completion's prompt), `decode_assistant_message(tokens, stop_reason)`
and `role_str`. The prompt is llama.tokenizers.llama4_chat's, token for token Meta's. Differences: images are
refused (vision_args, or an image in a message: no vision encoder here), and a decoded message is a dict ({"role",
"content", "stop_reason", "tool_calls": [{"name", "arguments"}]}) keeping every call of a list,
where Meta's RawMessage keeps the first."""

from typing import Dict, List, Tuple

from llama.llama4.datatypes import LLMInput
from llama.tokenizers.llama4_chat import Llama4ChatFormat
from llama.tokenizers.messages import NO_VISION, has_image

# llama-models' ToolPromptFormat values -> this package's tool syntax
TOOL_PROMPT_FORMATS = {"json": "llama3_json", "python_list": "pythonic"}


def role_str(role) -> str:
    """A role's header text (Meta's role_str): "tool" is written "ipython"."""
    role = getattr(role, "value", role)
    return "ipython" if role == "tool" else role


def as_message(m) -> Dict:
    """A dict message of llama-models' RawMessage (or a dict, as is)."""
    if isinstance(m, dict):
        return m
    content = m.content
    if has_image(content) or (isinstance(content, list) and any(has_image([c]) for c in content)):
        raise ValueError(f"a {m.role} message: {NO_VISION}")
    if isinstance(content, list):
        content = "".join(getattr(c, "text", c) for c in content)
    content = getattr(content, "text", content)
    calls = [{"name": getattr(c.tool_name, "value", c.tool_name), "arguments": c.arguments}
             for c in getattr(m, "tool_calls", None) or []]
    return {"role": m.role, "content": content, "tool_calls": calls,
            "stop_reason": getattr(getattr(m, "stop_reason", None), "value", None)}


def tool_family(tool_prompt_format) -> str:
    value = getattr(tool_prompt_format, "value", tool_prompt_format)
    if value not in TOOL_PROMPT_FORMATS:
        raise ValueError(f"tool_prompt_format must be one of {sorted(TOOL_PROMPT_FORMATS)}, got {value!r} "
                         "(function_tag is not written here)")
    return TOOL_PROMPT_FORMATS[value]


class ChatFormat(Llama4ChatFormat):
    """Meta's llama4 ChatFormat over this package's Llama 4 format."""

    def __init__(self, tokenizer, vision_args=None, max_num_chunks: int = 16):
        if vision_args is not None:
            raise ValueError(f"vision_args: {NO_VISION}")
        super().__init__(tokenizer)
        self.vision_args, self.max_num_chunks = None, max_num_chunks

    def encode_dialog_prompt(self, messages, tool_prompt_format="json") -> LLMInput:
        """Meta's: every message as given (no dialog rules), then the assistant header."""
        family = tool_family(tool_prompt_format)
        tokens = [self.special["<|begin_of_text|>"]]
        for m in messages:
            tokens += super().encode_message(as_message(m), family)
        return LLMInput(tokens + self.encode_header("assistant"))

    def encode_content(self, content) -> LLMInput:
        """Meta's completion prompt: the text of content (a string, a text item with .text, or a list of them),
        each piece encoded as it is, <|begin_of_text|> before the first; an image item is refused."""
        tokens = []
        for i, c in enumerate(content if isinstance(content, list) else [content]):
            text = getattr(c, "text", c)
            if not isinstance(text, str):
                raise ValueError(f"content item {i} is a {type(c).__name__}, not text: {NO_VISION}")
            tokens += self.tokenizer.encode(text, bos=i == 0, eos=False)
        return LLMInput(tokens)

    def encode_message(self, message, tool_prompt_format="json") -> Tuple[List[int], list]:
        """Meta's (tokens, images) of one message."""
        return super().encode_message(as_message(message), tool_family(tool_prompt_format)), []

    def encode_tool_dialog(self, dialog) -> List[int]:
        return Llama4ChatFormat(self.tokenizer, self.tool_style).encode_tool_dialog(dialog)
