"""Quantization schemes for the model's linear layers (int8 weight-only, int8-dynamic, group-wise int4), registered
as QuantScheme objects (registry.py, built-ins in schemes.py), and the `python -m llama.quantize` command that writes
quantized checkpoints."""
