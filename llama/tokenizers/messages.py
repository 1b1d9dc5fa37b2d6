"""Dialogs as every chat format takes them (chat_format.py, llama4_chat.py, tool_format.py): checking messages
(roles, text content, and a clear refusal of image content, which no model here can see: the text models are
loaded, Llama 3.2 Vision's and Llama 4's vision encoders are not implemented), and a dialog that carries its
template's extra variables (TemplateDialog)."""

import copy
from typing import Dict, Optional, Sequence

from llama.tokenizers.text import check_text

NO_VISION = ("image content is not supported: only the text model runs here (no vision encoder: Llama 4's and "
             "Llama 3.2 Vision's image inputs need one); send text content only")


def is_image(part) -> bool:
    """Whether a content part is an image: OpenAI's {"type": "image_url"}, llama-models' RawMediaItem or
    {"type": "image"}, or an image object (PIL)."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    if isinstance(kind, str) and "image" in kind:
        return True
    if isinstance(part, dict) and any(k in part for k in ("image", "image_url")):
        return True
    return isinstance(part, (bytes, bytearray)) or "Image" in type(part).__name__


def has_image(content) -> bool:
    parts = content if isinstance(content, (list, tuple)) else [content]
    return not isinstance(content, str) and any(is_image(p) for p in parts)


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
        if has_image(msg["content"]):
            raise ValueError(f"{where}, message {i}: {NO_VISION}")
        if not isinstance(msg["content"], str):
            raise ValueError(f"{where}, message {i}: content must be a str, got {type(msg['content']).__name__}")
        check_text(f"{where}, message {i}: content", msg["content"])


class TemplateDialog(list):
    """A dialog (its messages) plus the extra variables its chat template renders with."""

    def __init__(self, messages, template_kwargs: Optional[Dict] = None):
        super().__init__(messages)
        self.template_kwargs = dict(template_kwargs or {})


def with_template_kwargs(dialog, kwargs: Optional[Dict]):
    """dialog carrying kwargs for its template (dialog itself when there are none); a dialog that carries its
    own (a tool dialog) gets a copy with them added."""
    if not kwargs:
        return dialog
    if hasattr(dialog, "template_kwargs"):
        out = copy.copy(dialog)
        out.template_kwargs = {**dialog.template_kwargs, **kwargs}
        return out
    return TemplateDialog(dialog, kwargs)
