"""Getting a model to run: the default model, fetched once from its registry (fetch), and the random demo checkpoint the examples fall back to (demo)."""
