"""llama: Meta's Llama reference API, correct on every device, with serving features."""

import warnings

# `python -m llama.quantize` (and the other module CLIs) run a module that importing the package has imported
# already; runpy warns about that, but each CLI's __main__ block is written for it.
warnings.filterwarnings("ignore", message=r"'llama\.\w+' found in sys\.modules after import of package 'llama'",
                        category=RuntimeWarning)

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
