"""Tokenizers (sentencepiece for Llama 2, tiktoken for Llama 3, Hugging Face for GGUF vocabularies) and chat
formats. Every tokenizer has `stop_tokens` {id: finish_reason}; the core sees only that interface."""
