"""Weights on disk: Meta checkpoints, GGUF files, quantized checkpoints, resharding, the loader that turns any of
them into a model, the read-ahead and the memory check, the default model and random demo checkpoints."""
