"""Command-line programs (batch jobs, perplexity, conversions) and the examples' start-up. `python -m llama.X`
runs them through the leaf modules at the package's top level, which nothing imports."""
