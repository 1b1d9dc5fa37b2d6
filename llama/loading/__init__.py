"""Loading a model: the model factory behind Llama.build (loader), the check that a configuration fits in memory (memory), and reading mapped weights in before the first token (preload)."""
