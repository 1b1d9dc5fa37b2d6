"""python -m llama.batch: resumable JSONL generation jobs through the engine.

A leaf: nothing imports it, so `python -m` runs it once (the program is llama/cli/batch.py).
"""

if __name__ == "__main__":
    import sys

    from llama.cli.batch import main

    sys.exit(main())
