"""llama: Meta's Llama reference API, correct on every device, with serving features."""

from .engine import Engine
from .generation import ChatPrediction, CompletionPrediction, Llama
from .model import ModelArgs, Transformer
from .handle import Handle
from .params import SamplingParams
from .prefix import ChatSession, Prefix
from .chat import ChatFormat, Dialog, Message
from .tokenizer import Tokenizer

__all__ = ["Llama", "ModelArgs", "Transformer", "Tokenizer", "ChatFormat", "Dialog", "Message", "SamplingParams",
           "Prefix", "ChatSession", "Engine", "Handle", "CompletionPrediction", "ChatPrediction"]
