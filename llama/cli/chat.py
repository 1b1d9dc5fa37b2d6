"""`python -m llama chat`: talk to a model in the terminal, as `ollama run` or `llama-cli -cnv` do.

Replies stream as they are generated; the conversation is a ChatSession, so each turn prefills only its new
tokens. Ctrl-C stops a reply (the turn is dropped) without leaving; Ctrl-D or /bye leaves.
"""

import argparse
import signal
import sys
from typing import Iterator, Optional

from llama.cli.build_flags import add_model_flags, model_options

HELP = """commands:
  /system TEXT   start again with this system prompt (/system alone: none)
  /reset         start again, keeping the system prompt
  /bye           leave (or Ctrl-D)
  /help          this list
a line ending in \\ continues on the next line; \"\"\" opens and closes a block of several lines;
Ctrl-C stops a reply without leaving"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llama chat", description="Chat with a model in the terminal.")
    p.add_argument("--ckpt_dir", "--ckpt-dir", default=None,
                   help="Meta checkpoint directory or GGUF file (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--tokenizer_path", "--tokenizer-path", default=None)
    p.add_argument("--system", default=None, help="a system prompt for the conversation")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top_p", "--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=None, help="seeded sampling: the same conversation, the same replies")
    p.add_argument("--max_gen_len", "--max-gen-len", type=int, default=None, help="tokens per reply at most")
    p.add_argument("--max_seq_len", "--max-seq-len", type=int, default=4096, help="the whole conversation's tokens")
    add_model_flags(p)
    return p


def messages(read) -> Iterator[str]:
    """User messages from read(prompt) (a line, EOFError at the end): a trailing backslash continues a line, and a
    line of three double quotes opens and closes a block of several lines."""
    parts, block = [], False
    while True:
        try:
            line = read("... " if parts or block else ">>> ")
        except EOFError:
            return
        if line.strip() == '"""':
            if block:
                yield "\n".join(parts)
                parts = []
            block = not block
        elif block:
            parts.append(line)
        elif line.endswith("\\"):
            parts.append(line[:-1])
        else:
            yield "\n".join([*parts, line])
            parts = []


class Interrupt:
    """While a reply streams, Ctrl-C sets a flag the loop checks between deltas, so the stream is closed cleanly
    (its request cancelled, the cache released) instead of being torn down inside a forward pass."""

    def __init__(self):
        self.hit = False

    def __enter__(self):
        self.hit, self.previous = False, signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, *_):
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


def reply(session, message: str, options: dict, out=sys.stdout) -> bool:
    """Stream one reply; False when Ctrl-C stopped it (the turn is not kept)."""
    with Interrupt() as interrupt:
        stream = session.stream(message, **options)
        try:
            for delta in stream:
                out.write(delta)
                out.flush()
                if interrupt.hit:
                    break
        finally:
            getattr(stream, "close", lambda: None)()  # a refusal is a plain iterator
    out.write(" [stopped]\n" if interrupt.hit else "\n")
    return not interrupt.hit


def command(session_factory, state: dict, text: str, out=sys.stdout) -> Optional[bool]:
    """Run a /command; None if text is not one, False to leave."""
    name, _, arg = text.strip().partition(" ")
    if not text.startswith("/") or name not in ("/system", "/reset", "/bye", "/exit", "/help"):
        return None
    if name in ("/bye", "/exit"):
        return False
    if name == "/help":
        out.write(HELP + "\n")
        return True
    if name == "/system":
        state["system"] = arg.strip() or None
    state["session"] = session_factory(state["system"])
    out.write("(a new conversation" + (f", system: {state['system']!r})\n" if state["system"] else ")\n"))
    return True


class Prompting:
    """For the whole conversation: Ctrl-C at the prompt clears it, and one that lands anywhere else (between the
    Enter key and the reply's start, or in a command) is dropped instead of ending the program; while a reply
    streams, its own Interrupt takes Ctrl-C."""

    def __init__(self):
        self.at_prompt = False

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, *_):
        if self.at_prompt:  # once per prompt: a second Ctrl-C while the first is handled is dropped
            self.at_prompt = False
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)

    def read_line(self, prompt: str) -> str:
        """A line from the terminal; Ctrl-C at the prompt only clears it."""
        while True:
            self.at_prompt = True
            try:
                line = input(prompt)
                self.at_prompt = False  # a Ctrl-C before this line drops the line read, as at the prompt
                return line
            except KeyboardInterrupt:
                print("^C (/bye or Ctrl-D leaves)")
            except EOFError:
                self.at_prompt = False
                raise


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from llama.cli.launch import build_for_example

    try:  # --seed seeds sampling here, not the build
        generator, _ = build_for_example(args.ckpt_dir, args.tokenizer_path, max_seq_len=args.max_seq_len,
                                         max_batch_size=1, **model_options(args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    options = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "max_gen_len": args.max_gen_len}
    state = {"system": args.system}
    state["session"] = generator.chat_session(args.system)
    print("Type a message (/help for commands, /bye or Ctrl-D to leave).")
    with Prompting() as prompting:
        for text in messages(prompting.read_line):
            if not text.strip():
                continue
            done = command(generator.chat_session, state, text)
            if done is False:
                break
            if done is None:
                try:
                    reply(state["session"], text, options)
                except ValueError as e:  # e.g. the conversation outgrew max_seq_len
                    print(f"error: {e}")
    return 0
