"""Meta's `llama.tokenizer` module path (Llama 2's and Llama 3's repositories): its public names, from
llama/tokenizers/."""

from llama.tokenizers.chat_format import ChatFormat, Dialog, Message
from llama.tokenizers.sentencepiece import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer", "ChatFormat", "Dialog", "Message"]
