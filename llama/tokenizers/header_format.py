"""What Llama 3's and Llama 4's chat formats share: Meta's role headers (special start and end tokens around the
role, then a blank line; role "tool" written "ipython"), the dialog checks, and content kept as plain text."""

from typing import Dict, List, Optional, Tuple, Union

from llama.tokenizers.messages import validate_messages


class HeaderChatFormat:
    """The chat-format interface's shared half; a subclass names its HEADER tokens and encodes its messages."""

    strip_reply_space = False
    ROLES = ("system", "user", "assistant", "ipython", "tool")
    HEADER: Tuple[str, str] = ("", "")  # the special tokens before and after a role

    def __init__(self, tokenizer, tool_style: str):
        self.tokenizer = tokenizer
        self.tool_style = tool_style  # Meta's tool syntax: llama3_json or pythonic
        self.special = tokenizer.special_tokens
        self.stop_tokens: Dict[int, str] = {}  # the tokenizer's eos/eot/eom already stop every generation

    def validate(self, dialog, index: int = 0) -> None:
        if hasattr(dialog, "render_with"):
            return dialog.validate_with(self, index)
        validate_messages(dialog, index, self.ROLES)
        for i, msg in enumerate(dialog):
            if msg["role"] == "system" and i > 0:
                raise ValueError(f"dialog {index}, message {i}: a system message may only come first")
        if dialog[-1]["role"] in ("assistant", "system"):
            raise ValueError(f"dialog {index}: the last message must be from the user or a tool (ipython), got "
                             f"{dialog[-1]['role']!r}")

    def refusal(self, dialog) -> Optional[str]:
        return None  # special-token text in content is encoded as plain text, so nothing needs refusing

    def encode_header(self, role: Union[str, Dict]) -> List[int]:
        """The header of a role, or of a message (Meta's encode_header(message) / _encode_header)."""
        role = role["role"] if isinstance(role, dict) else role
        role = "ipython" if role == "tool" else role
        start, end = self.HEADER
        return ([self.special[start]] + self.tokenizer.encode(role, bos=False, eos=False)
                + [self.special[end]] + self.tokenizer.encode("\n\n", bos=False, eos=False))
