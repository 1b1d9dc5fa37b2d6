"""llama: Meta's Llama reference API, correct on every device, with serving features."""

from llama.config import BuildArgs, LlamaConfig
from llama.core.frontend.engine import Engine, EngineStopped
from llama.core.frontend.params import SamplingParams
from llama.core.frontend.prefix import Prefix
from llama.core.frontend.request import BatchError, Request
from llama.core.frontend.session import ChatSession
from llama.generation import ChatPrediction, CompletionPrediction, Llama
from llama.model import ModelArgs, Transformer
from llama.sample.grammar import Grammar
from llama.tokenizers.chat_format import ChatFormat, Dialog, Message
from llama.tokenizers.sentencepiece import Tokenizer

__all__ = ["Llama", "ModelArgs", "Transformer", "Tokenizer", "ChatFormat", "Dialog", "Message", "SamplingParams",
           "Prefix", "ChatSession", "Engine", "EngineStopped", "Request", "BatchError", "CompletionPrediction",
           "ChatPrediction", "Grammar", "BuildArgs", "LlamaConfig"]


def __getattr__(name: str):
    if name == "Handle":  # Engine.submit's result before requests became one object: kept for code that names it
        import warnings

        warnings.warn("llama.Handle is deprecated: use llama.Request", DeprecationWarning, stacklevel=2)
        return Request
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
