"""`python -m llama chat`, driven through a pseudo-terminal as a person would: streamed replies that equal
chat_completion's for the same dialog, /system and /reset, multi-line input, Ctrl-C that stops a reply (or clears
the prompt) without leaving, and Ctrl-D."""

import re
import sys

import pytest
from conftest import REPO, STORIES, need, rank_env

from llama.cli.chat import messages, reply

pexpect = pytest.importorskip("pexpect", reason="the terminal test drives a pty with pexpect: pip install -e '.[test]'")

PROMPT = ">>> "


def test_messages_joins_continued_lines_and_blocks():
    lines = iter(["one", "two \\", "three", '"""', "a", "", "b", '"""', "last"])
    prompts = []

    def read(prompt):
        prompts.append(prompt)
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    assert list(messages(read)) == ["one", "two \nthree", "a\n\nb", "last"]
    assert prompts == [">>> ", ">>> ", "... ", ">>> ", "... ", "... ", "... ", "... ", ">>> ", ">>> "]


def say(child, text: str) -> str:
    """Send one message (or command) and return what the program printed before its next prompt."""
    child.sendline(text)
    for line in text.split("\n"):
        child.expect_exact(line)  # the terminal's echo of what was typed
    child.expect_exact(PROMPT)
    return re.sub(r"^(\.\.\. )+", "", child.before.replace("\r\n", "\n").strip("\n")).strip()


def test_a_conversation_in_the_terminal(stories):
    need(STORIES / "consolidated.00.pth")
    child = pexpect.spawn(sys.executable, ["-m", "llama", "chat", "--ckpt_dir", str(STORIES), "--temperature", "0",
                                           "--max_gen_len", "24", "--max_seq_len", "256"],
                          env=rank_env(), cwd=str(REPO), encoding="utf-8", timeout=120, dimensions=(50, 400))
    try:
        child.expect_exact(PROMPT)

        def alone(dialog):
            return stories.chat_completion([dialog], temperature=0, max_gen_len=24)[0]["generation"]["content"]

        first = say(child, "Hello there")
        assert first == alone([{"role": "user", "content": "Hello there"}]).strip()
        second = say(child, "Tell me a story")
        dialog = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
                  {"role": "user", "content": "Tell me a story"}]
        assert second == alone(dialog).strip()

        assert "system: 'You are a cat.'" in say(child, "/system You are a cat.")
        block = say(child, '"""\nOne line.\nAnother line.\n"""')
        assert block == alone([{"role": "system", "content": "You are a cat."},
                               {"role": "user", "content": "One line.\nAnother line."}]).strip()
        assert "(a new conversation" in say(child, "/reset")

        child.sendintr()  # at the prompt: clears it, the conversation goes on
        child.expect_exact("^C (/bye or Ctrl-D leaves)")
        child.expect_exact(PROMPT)
        system = [{"role": "system", "content": "You are a cat."}]
        assert say(child, "Hello there") == alone(system + [{"role": "user", "content": "Hello there"}]).strip()
        child.sendline("Once upon a time")  # a reply Ctrl-C may stop or follow: either way the program stays
        child.sendintr()
        child.expect_exact(PROMPT)
        assert "/help" in say(child, "/help")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_a_reply_and_drops_the_turn():
    """A SIGINT while a reply streams ends it at the next delta and closes the stream (its request cancelled,
    the session's turn not recorded), instead of raising KeyboardInterrupt from inside a forward pass."""
    import io
    import os
    import signal

    closed = []

    class Session:
        def stream(self, message, **options):
            def deltas():
                try:
                    yield "One"
                    os.kill(os.getpid(), signal.SIGINT)
                    yield " two"
                    yield " three"
                finally:
                    closed.append(True)
            return deltas()

    out = io.StringIO()
    assert reply(Session(), "hi", {}, out) is False
    assert out.getvalue() == "One two [stopped]\n" and closed == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    out = io.StringIO()
    assert reply(type("S", (), {"stream": lambda self, m, **o: iter(["a", "b"])})(), "hi", {}, out) is True
    assert out.getvalue() == "ab\n"


def test_ctrl_c_outside_the_prompt_and_a_reply_is_dropped(monkeypatch):
    """Between the Enter key and the reply's start a Ctrl-C used to raise KeyboardInterrupt out of the program (a
    flaky end of test_a_conversation_in_the_terminal): now it is dropped there, and at the prompt it clears the line
    once."""
    import os
    import signal

    from llama.cli.chat import Prompting

    lines = iter(["first"])

    def read(prompt):
        if prompting.at_prompt and not read.interrupted:
            read.interrupted = True
            os.kill(os.getpid(), signal.SIGINT)  # at the prompt: clears it
        return next(lines)

    read.interrupted = False
    monkeypatch.setattr("builtins.input", read)
    with Prompting() as prompting:
        os.kill(os.getpid(), signal.SIGINT)  # between prompts: dropped, no KeyboardInterrupt
        assert prompting.read_line(">>> ") == "first" and read.interrupted
        assert not prompting.at_prompt
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
