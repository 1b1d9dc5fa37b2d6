"""llama: Meta's Llama reference API, correct on every device, with serving features."""

from llama.core.engine import Engine, EngineStopped
from llama.core.params import SamplingParams
from llama.core.prefix import Prefix
from llama.core.request import BatchError, Handle, Request
from llama.core.session import ChatSession
from llama.generation import ChatPrediction, CompletionPrediction, Llama
from llama.model import ModelArgs, Transformer
from llama.sample.grammar import Grammar
from llama.tokenizers.chat_format import ChatFormat, Dialog, Message
from llama.tokenizers.sentencepiece import Tokenizer

__all__ = ["Llama", "ModelArgs", "Transformer", "Tokenizer", "ChatFormat", "Dialog", "Message", "SamplingParams",
           "Prefix", "ChatSession", "Engine", "EngineStopped", "Request", "Handle", "BatchError", "CompletionPrediction",
           "ChatPrediction", "Grammar"]
