"""The chat page at / in a real headless chromium (playwright driving Debian's chromium): send a message, see the
streamed answer appear, stop a long one, start a new conversation; a screenshot of the stopped, partial answer is
saved."""

import os
import shutil
import time

import pytest
from conftest import STORIES, need

pytest.importorskip("starlette", reason="the server needs the serve extra: pip install -e '.[serve]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="the page test needs playwright: pip install playwright")
httpx = pytest.importorskip("httpx")

from helpers import Gate, GatedServer, build_stories  # noqa: E402

CHROMIUM = os.environ.get("LLAMA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server():
    """The server in this process, every answer held after 16 tokens until the test opens the gate: the stop
    button is pressed mid-answer however fast the machine is."""
    need(STORIES)
    s = GatedServer(build_stories(max_batch_size=2, max_seq_len=1024), Gate(after=16), api_keys=["page-key"])
    yield s
    s.close()


@pytest.fixture(scope="module")
def page(server):
    if CHROMIUM is None:
        pytest.skip("no chromium found: apt-get install chromium (or set LLAMA_CHROMIUM)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        pg = browser.new_page()
        pg.goto(server.url + "/")
        yield pg
        browser.close()


def aborted(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith('llama_sequences_finished_total{reason="abort"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_chat_page_streams_stops_and_keeps_conversations(server, page, tmp_path):
    assert page.is_visible("#apikey")  # the server needs a key: the page asks for it
    page.fill("#apikey", "wrong")
    page.dispatch_event("#apikey", "change")
    page.fill("#input", "Tell me a story")
    page.click("#send")
    page.wait_for_selector(".msg.error", timeout=10000)
    assert "API key" in page.inner_text(".msg.error")

    page.fill("#apikey", "page-key")
    page.dispatch_event("#apikey", "change")
    page.fill("#max_tokens", "900")
    page.dispatch_event("#max_tokens", "change")
    page.fill("#temperature", "0")  # greedy: this answer runs to its 900 tokens (no early end of story)
    page.dispatch_event("#temperature", "change")
    page.fill("#system", "You tell long stories.")
    page.click("#new")
    page.fill("#input", "Tell me a long story about a dragon")
    before = aborted(server)
    page.click("#send")
    page.wait_for_function("() => { const m = document.querySelectorAll('.msg.assistant');"
                           " return m.length && m[m.length - 1].textContent.length > 20; }", timeout=30000)
    first = page.inner_text(".msg.assistant")
    assert server.gate.reached.wait(30) and page.is_enabled("#stop")  # held mid-answer by the gate
    page.click("#stop", timeout=5000)
    shot = os.environ.get("LLAMA_SCREENSHOT") or str(tmp_path / "chat_page_mid_answer.png")
    page.screenshot(path=shot)  # the partial answer, stopped
    print(f"screenshot: {shot}")
    page.wait_for_function("() => document.getElementById('status').textContent === 'stopped'", timeout=10000)
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    deadline = time.time() + 30
    while not server.requests[-1].cancelled:  # the page's abort reached the server while generation was held
        assert time.time() < deadline, "stopping the answer did not cancel its request"
        time.sleep(0.05)
    server.gate.open()
    while aborted(server) < before + 1:  # the server ended it as aborted
        assert time.time() < deadline
        time.sleep(0.05)
    assert len(page.inner_text(".msg.assistant")) >= len(first)  # the partial answer stays
    assert server.requests[-1].tokens_generated < 900

    # a second turn in the same conversation, run to its end
    page.fill("#max_tokens", "20")
    page.dispatch_event("#max_tokens", "change")
    page.fill("#input", "And then?")
    page.click("#send")
    page.wait_for_function("() => !document.getElementById('send').disabled && "
                           "document.querySelectorAll('.msg.assistant').length == 2", timeout=30000)
    last = page.query_selector_all(".msg.assistant")[-1]
    stats = last.query_selector(".stats").inner_text()  # the server's usage count, and the measured speed
    assert stats.startswith("20 tokens · ") and " tok/s · first token " in stats, stats
    stored = page.evaluate("() => JSON.parse(localStorage.getItem('llama-chat-v1'))")
    conv = next(c for c in stored["convs"] if c["id"] == stored["current"])
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "user", "assistant"]
    assert conv["system"] == "You tell long stories."
    assert len(stored["convs"]) == 2  # the first conversation (with the failed message) is kept too

    page.reload()  # conversations survive a reload
    page.wait_for_selector(".msg.assistant")
    assert len(page.query_selector_all(".msg.user")) == 2
    page.click("#new")
    assert page.query_selector_all(".msg") == []
