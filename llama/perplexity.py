"""python -m llama.perplexity: sliding-window perplexity of a text file.

A leaf: nothing imports it, so `python -m` runs it once (the program is llama/cli/perplexity.py).
"""

if __name__ == "__main__":
    import sys

    from llama.cli.perplexity import cli

    sys.exit(cli())
