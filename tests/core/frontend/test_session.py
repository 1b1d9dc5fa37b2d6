"""Chat sessions: each turn equals chat_completion on the whole dialog, prefilling only its new tokens."""


import pytest


# --------------------------------------------------------------------------------------------- chat sessions
def test_chat_session_equals_chat_completion(stories):
    session = stories.chat_session(system="You tell stories.")
    messages = ["Tell me about a cat.", "What did the cat eat?", "And then?", "Who is Lily?"]
    kw = dict(temperature=0, max_gen_len=30)
    fmt = stories.formatter
    for turn, msg in enumerate(messages):
        before = list(session.dialog)
        cached = session.cache.tokens if session.cache else []
        kept = session.cache.blocks if session.cache else []
        if turn % 2:
            reply = "".join(session.stream(msg, **kw))
        else:
            reply = session.send(msg, **kw)
        dialog = before + [{"role": "user", "content": msg}]
        assert session.dialog == dialog + [{"role": "assistant", "content": reply}]
        assert reply == stories.chat_completion([dialog], **kw)[0]["generation"]["content"]
        prompt = fmt.encode_dialog_prompt(dialog)
        if turn == 0:
            assert session.last_prefilled == len(prompt)
        else:
            # Only the new tokens were computed: at least the whole previous prompt came from the cache...
            assert 0 < session.last_prefilled <= len(prompt) - len(fmt.encode_dialog_prompt(before[:-1]))
            # ...and exactly the tokens after the common start of the cached conversation and this prompt.
            common = next((i for i, (a, b) in enumerate(zip(cached, prompt)) if a != b), min(len(cached), len(prompt)))
            assert session.last_prefilled == len(prompt) - min(common, len(prompt) - 1)
            # ...from the previous turn's own pool blocks: this turn's keeps the full ones it shared.
            full = min(common, len(prompt) - 1) // stories.cache.block_size
            assert full >= 1 and session.cache.blocks[:full] == kept[:full]


def test_chat_session_sampled_and_stop(stories):
    session = stories.chat_session()
    kw = dict(temperature=1.0, top_p=0.9, seed=21, max_gen_len=40, stop=["."])
    for msg in ("Tell me a story.", "More please."):
        dialog = session.dialog + [{"role": "user", "content": msg}]
        reply = session.send(msg, **kw)
        assert "." not in reply
        assert reply == stories.chat_completion([dialog], **kw)[0]["generation"]["content"]


def test_chat_session_too_long(stories):
    session = stories.chat_session()
    session.send("Hi", temperature=0, max_gen_len=5)
    before = list(session.dialog)
    with pytest.raises(ValueError, match="max_seq_len"):
        session.send("word " * 300, temperature=0)
    assert session.dialog == before  # the failed turn left the conversation as it was
    with pytest.raises(ValueError, match="message"):
        session.send(42)
    with pytest.raises(ValueError, match="echo is not available in a chat session"):
        session.send("Hi again", echo=True, logprobs=True)
    # Still usable, and still equal to the from-scratch answer.
    reply = session.send("Bye", temperature=0, max_gen_len=10)
    dialog = before + [{"role": "user", "content": "Bye"}]
    assert reply == stories.chat_completion([dialog], temperature=0, max_gen_len=10)[0]["generation"]["content"]
