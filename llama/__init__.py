"""llama: Meta's Llama reference API, correct on every device, with serving features."""

from .generation import ChatPrediction, CompletionPrediction, Llama
from .model import ModelArgs, Transformer
from .params import SamplingParams
from .prefix import ChatSession, Prefix
from .tokenizer import ChatFormat, Dialog, Message, Tokenizer

__all__ = ["Llama", "ModelArgs", "Transformer", "Tokenizer", "ChatFormat", "Dialog", "Message", "SamplingParams",
           "Prefix", "ChatSession", "CompletionPrediction", "ChatPrediction"]
