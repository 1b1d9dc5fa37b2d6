"""python -m llama.convert llama2c|hf|gguf ...: other formats -> Meta's checkpoint layout.

A leaf: nothing imports it, so `python -m` runs it once (the program is llama/cli/convert.py).
"""

if __name__ == "__main__":
    import sys

    from llama.cli.convert import main

    sys.exit(main())
