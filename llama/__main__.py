"""`python -m llama chat [...]`: the package's commands (a leaf: nothing imports it)."""

import sys

COMMANDS = {"chat": "talk to a model in the terminal (python -m llama chat --help)"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        listing = "\n".join(f"  {name}  {what}" for name, what in COMMANDS.items())
        print(f"usage: python -m llama COMMAND [...]\ncommands:\n{listing}", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    from llama.cli.chat import main as chat

    return chat(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
