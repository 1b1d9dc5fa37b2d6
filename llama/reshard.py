"""python -m llama.reshard IN_DIR OUT_DIR --shards N: rewrite a checkpoint with another shard count.

A leaf: nothing imports it, so `python -m` runs it once (the program is llama/formats/reshard.py).
"""

if __name__ == "__main__":
    import sys

    from llama.formats.reshard import main

    sys.exit(main())
