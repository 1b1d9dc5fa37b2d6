"""Meta's llama-models module paths for Llama 4 (`llama_models.llama4.X` is `llama.llama4.X` here), for code
written against them."""
