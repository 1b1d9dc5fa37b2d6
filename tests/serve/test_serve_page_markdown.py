"""The chat page renders answers as markdown, safely, shows each answer's speed and regenerates the last one: in a
real headless chromium (playwright driving Debian's chromium). The answers come from a scripted stream (playwright
answers the page's /v1/chat/completions request) so that they can hold HTML and script tags; the real server's
stream is test_serve_page.py's."""

import json
import os
import shutil

import pytest
from conftest import STORIES, need

pytest.importorskip("starlette", reason="the server needs the serve extra: pip install -e '.[serve]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="the page test needs playwright: pip install playwright")

from helpers import Gate, GatedServer, build_stories  # noqa: E402

CHROMIUM = os.environ.get("LLAMA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")

HOSTILE = ("Here is **bold**, *italic* and `code`.\n\n"
           "<script>window.__pwned = 1</script>\n"
           '<img src="x" onerror="window.__pwned = 2">\n\n'
           "[click](javascript:window.__pwned=3) and [docs](https://example.com/a)\n\n"
           "```python\nprint('<b>not bold</b>')\n```\n\n"
           "- one\n- two\n")


def sse(text: str, pieces: int = 6) -> str:
    """An OpenAI chat stream of `text` in `pieces` deltas, then the usage chunk and [DONE]."""
    step = max(1, len(text) // pieces)
    chunks = [{"choices": [{"index": 0, "delta": {"content": text[i : i + step]}, "finish_reason": None}]}
              for i in range(0, len(text), step)]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 17, "total_tokens": 22}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def page():
    need(STORIES)
    if CHROMIUM is None:
        pytest.skip("no chromium found: apt-get install chromium (or set LLAMA_CHROMIUM)")
    server = GatedServer(build_stories(max_batch_size=1, max_seq_len=256), Gate(after=10**6), api_keys=[])
    replies, bodies = [HOSTILE, "A **second** answer."], []

    def answer(route, request):
        bodies.append(json.loads(request.post_data))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse(replies[len(bodies) - 1]))

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        pg = browser.new_page()
        dialogs = []
        pg.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        pg.route("**/v1/chat/completions", answer)
        pg.goto(server.url + "/")
        yield pg, bodies, dialogs
        browser.close()
    server.close()


def test_markdown_renders_and_html_in_the_answer_stays_text(page):
    pg, bodies, dialogs = page
    pg.fill("#input", "Show me something")
    pg.click("#send")
    pg.wait_for_selector(".msg.assistant .stats", timeout=20000)
    msg = pg.query_selector(".msg.assistant")
    assert pg.evaluate("() => window.__pwned") is None and dialogs == []  # nothing in the answer ran
    assert msg.query_selector("script") is None and msg.query_selector("img") is None
    text = msg.inner_text()
    assert "<script>window.__pwned = 1</script>" in text and '<img src="x" onerror=' in text  # shown as text
    assert msg.query_selector("strong").inner_text() == "bold" and msg.query_selector("em").inner_text() == "italic"
    code = msg.query_selector("pre > code.language-python")
    assert code.inner_text() == "print('<b>not bold</b>')" and code.query_selector("b") is None
    assert [li.inner_text() for li in msg.query_selector_all("ul > li")] == ["one", "two"]
    links = msg.query_selector_all("a")
    assert [a.get_attribute("href") for a in links] == ["https://example.com/a"]  # javascript: stays text
    assert "[click](javascript:window.__pwned=3)" in text
    assert bodies[0]["stream_options"] == {"include_usage": True}


def test_each_answer_shows_its_speed_and_regenerate_replaces_the_last(page):
    pg, bodies, _ = page
    stats = pg.inner_text(".msg.assistant .stats")
    assert stats.startswith("17 tokens · ") and " tok/s · first token " in stats and stats.endswith(" ms"), stats
    assert pg.is_enabled("#regen")
    pg.click("#regen")
    pg.wait_for_function("() => document.querySelector('.msg.assistant strong') &&"
                         " document.querySelector('.msg.assistant strong').textContent === 'second'"
                         " && !document.getElementById('send').disabled", timeout=20000)
    assert len(pg.query_selector_all(".msg.assistant")) == 1 and len(pg.query_selector_all(".msg.user")) == 1
    assert [m["role"] for m in bodies[1]["messages"]] == ["user"]  # the same question, without the old answer
    stored = pg.evaluate("() => JSON.parse(localStorage.getItem('llama-chat-v1'))")
    conv = next(c for c in stored["convs"] if c["id"] == stored["current"])
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert conv["messages"][1]["content"] == "A **second** answer." and conv["messages"][1]["stats"]["tokens"] == 17
    pg.reload()  # markdown and the speed line come back from storage
    pg.wait_for_selector(".msg.assistant strong")
    assert "17 tokens" in pg.inner_text(".msg.assistant .stats")
