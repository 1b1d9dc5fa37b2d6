"""llama: Meta's Llama reference API, correct on every device, with serving features."""

from .chat import ChatFormat, Dialog, Message
from .engine import Engine, EngineStopped
from .generation import ChatPrediction, CompletionPrediction, Llama
from .grammar import Grammar
from .model import ModelArgs, Transformer
from .params import SamplingParams
from .prefix import Prefix
from .request import BatchError, Handle, Request
from .session import ChatSession
from .tokenizer import Tokenizer

__all__ = ["Llama", "ModelArgs", "Transformer", "Tokenizer", "ChatFormat", "Dialog", "Message", "SamplingParams",
           "Prefix", "ChatSession", "Engine", "EngineStopped", "Request", "Handle", "BatchError", "CompletionPrediction",
           "ChatPrediction", "Grammar"]
