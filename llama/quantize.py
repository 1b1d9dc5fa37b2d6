"""python -m llama.quantize CKPT_DIR OUT_DIR --scheme int8|int4: write a quantized checkpoint.

A leaf: nothing imports it, so `python -m` runs it once (the program is llama/quantization/cli.py).
"""

if __name__ == "__main__":
    import sys

    from llama.quantization.cli import main

    sys.exit(main())
