"""SentencePiece tokenizer and the Llama 2 chat template, as Meta's reference builds them."""

import os
from typing import List, Literal, Sequence, TypedDict

from sentencepiece import SentencePieceProcessor

Role = Literal["system", "user", "assistant"]


class Message(TypedDict):
    role: Role
    content: str


Dialog = Sequence[Message]

B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
SPECIAL_TAGS = [B_INST, E_INST, "<<SYS>>", "<</SYS>>"]
UNSAFE_ERROR = "Error: special tags are not allowed as part of the prompt."


class Tokenizer:
    def __init__(self, model_path: str):
        if not isinstance(model_path, (str, os.PathLike)):
            raise TypeError(f"tokenizer path must be a str or path, got {type(model_path).__name__}")
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model {str(model_path)!r} not found")
        try:
            self.sp_model = SentencePieceProcessor(model_file=str(model_path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{model_path} is not a valid sentencepiece model: {e}") from None
        self.n_words: int = self.sp_model.vocab_size()
        self.bos_id: int = self.sp_model.bos_id()
        self.eos_id: int = self.sp_model.eos_id()
        self.pad_id: int = self.sp_model.pad_id()
        if self.sp_model.vocab_size() != self.sp_model.get_piece_size():
            raise ValueError(f"{model_path}: inconsistent vocabulary size")

    def encode(self, s: str, bos: bool, eos: bool) -> List[int]:
        if not isinstance(s, str):
            raise TypeError(f"encode expects a str, got {type(s).__name__}")
        t = self.sp_model.encode(s)
        if bos:
            t = [self.bos_id] + t
        if eos:
            t = t + [self.eos_id]
        return t

    def decode(self, t: List[int]) -> str:
        return self.sp_model.decode(list(t))

    def piece(self, token_id: int) -> str:
        return self.sp_model.id_to_piece(token_id)


def validate_dialog(dialog, index: int = 0) -> None:
    """Raise ValueError saying what is wrong with a dialog (index names it within a batch)."""
    where = f"dialog {index}"
    if not isinstance(dialog, (list, tuple)) or not dialog:
        raise ValueError(f"{where} must be a non-empty list of messages, got {dialog!r:.80}")
    for i, msg in enumerate(dialog):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(f"{where}, message {i}: must be a dict with 'role' and 'content', got {msg!r:.80}")
        if msg["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"{where}, message {i}: unknown role {msg['role']!r} (use system, user or assistant)")
        if not isinstance(msg["content"], str):
            raise ValueError(f"{where}, message {i}: content must be a str, got {type(msg['content']).__name__}")
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
    """The Llama 2 chat template."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

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

