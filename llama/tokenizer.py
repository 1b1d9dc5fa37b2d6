"""Meta's `llama.tokenizer` module path, for Llama 2's and Llama 3's repositories at once: `Tokenizer(path)` reads
either Meta tokenizer file and `ChatFormat(tokenizer)` renders that tokenizer's family's template (both from
llama/tokenizers/)."""

from llama.tokenizers.chat_format import ChatFormat, Dialog, Message, Role
from llama.tokenizers.sentencepiece import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer", "ChatFormat", "Dialog", "Message", "Role"]
