"""Chat formats: turning a dialog into prompt tokens, one interface for every model family.

A chat format offers validate(dialog, index), encode_dialog_prompt(dialog) -> token ids, refusal(dialog) (the
answer to give instead of running a dialog the format forbids, or None), strip_reply_space (drop the reply's
first space, which the template puts after its last tag) and stop_tokens ({id: finish_reason}, added to the
tokenizer's for chat replies). `chat_format_for(tokenizer)` picks the format that belongs to a tokenizer.
"""

from typing import Dict, List, Literal, Optional, Sequence, TypedDict

Role = Literal["system", "user", "assistant"]


class Message(TypedDict):
    role: Role
    content: str


Dialog = Sequence[Message]

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
SPECIAL_TAGS = [B_INST, E_INST, "<<SYS>>", "<</SYS>>"]
UNSAFE_ERROR = "Error: special tags are not allowed as part of the prompt."


def validate_messages(dialog, index: int = 0, roles: Sequence[str] = ("system", "user", "assistant")) -> None:
    """Raise ValueError unless dialog is a non-empty list of {'role', 'content': str} with known roles."""
    where = f"dialog {index}"
    if not isinstance(dialog, (list, tuple)) or not dialog:
        raise ValueError(f"{where} must be a non-empty list of messages, got {dialog!r:.80}")
    for i, msg in enumerate(dialog):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(f"{where}, message {i}: must be a dict with 'role' and 'content', got {msg!r:.80}")
        if msg["role"] not in roles:
            raise ValueError(f"{where}, message {i}: unknown role {msg['role']!r} (use {', '.join(roles)})")
        if not isinstance(msg["content"], str):
            raise ValueError(f"{where}, message {i}: content must be a str, got {type(msg['content']).__name__}")


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
    """The Llama 2 chat template, token for token as Meta's reference builds it."""

    strip_reply_space = True  # the reply follows "[/INST]" and starts with the template's separator space
    stop_tokens: Dict[int, str] = {}

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def validate(self, dialog, index: int = 0) -> None:
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
        validate_dialog(dialog)
        msgs = self.fold_system(dialog)
        tokens: List[int] = []
        for prompt, answer in zip(msgs[::2], msgs[1::2]):
            tokens += self.encode_turn(prompt["content"], answer["content"])
        return tokens + self.encode_prompt_turn(msgs[-1]["content"])


def chat_format_for(tokenizer) -> ChatFormat:
    """The chat format that belongs to a tokenizer (the family is decided by the tokenizer, not by a flag)."""
    return ChatFormat(tokenizer)
