"""llama-models' `llama_models.llama4.tokenizer` names, for code written against it: `Tokenizer(model_path)`
(llama.tokenizers.llama4.Llama4Tokenizer: Meta's special_tokens, model, n_words, bos/eos/pad/eot/eom ids,
encode(s, bos=, eos=, allowed_special=, disallowed_special=), decode, plus this package's stop_tokens map and
piece), the special-token lists and the encoding limits. No tokenizer.model ships with this package, so there is
no Tokenizer.get_instance(): pass the file's path."""

from llama.tokenizers.llama3 import MAX_CHARS as TIKTOKEN_MAX_ENCODE_CHARS
from llama.tokenizers.llama3 import MAX_RUN as MAX_NO_WHITESPACES_CHARS
from llama.tokenizers.llama4 import (BASIC_SPECIAL_TOKENS, LLAMA4_SPECIAL_TOKENS, REASONING, TEXT_POST_TRAIN, VISION,
                                     Llama4Tokenizer)
from llama.tokenizers.llama4 import reserved as get_reserved_special_tokens

Tokenizer = Llama4Tokenizer
LLAMA4_TEXT_POST_TRAIN_SPECIAL_TOKENS = TEXT_POST_TRAIN
LLAMA4_VISION_SPECIAL_TOKENS = VISION
LLAMA4_REASONING_SPECIAL_TOKENS = REASONING

__all__ = ["Tokenizer", "get_reserved_special_tokens", "BASIC_SPECIAL_TOKENS", "LLAMA4_SPECIAL_TOKENS",
           "LLAMA4_TEXT_POST_TRAIN_SPECIAL_TOKENS", "LLAMA4_VISION_SPECIAL_TOKENS", "LLAMA4_REASONING_SPECIAL_TOKENS",
           "TIKTOKEN_MAX_ENCODE_CHARS", "MAX_NO_WHITESPACES_CHARS"]
