"""Per-request parameters: per-prompt values, logits processors, and clear errors naming a bad parameter."""


import pytest
from helpers import LILY, ONCE


# --------------------------------------------------------------------------------------------- logits processors
def test_logits_processor_bans_token(stories, goldens):
    banned = goldens[ONCE]["generated_tokens"][0]  # the greedy first token, frequent in the golden text
    seen = []

    def ban(ids, logits):
        seen.append(list(ids))
        logits = logits.clone()
        logits[banned] = float("-inf")
        return logits

    res = stories.text_completion([ONCE, LILY], temperature=0, max_gen_len=40, logits_processors=[ban])
    free = stories.text_completion([ONCE], temperature=0, max_gen_len=40)[0]["generation"]
    assert res[0]["generation"] != free
    toks, _ = stories.generate([goldens[ONCE]["prompt_tokens"]], 40, temperature=0)
    assert banned in toks[0]
    # The processor saw each row's generated tokens so far, growing one at a time; the banned id never appears.
    assert sorted({len(s) for s in seen}) == list(range(40))
    assert all(banned not in s for s in seen)


# --------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("name,value", [
    ("top_k", -1), ("top_k", 1.5), ("stop", [""]), ("stop", [3]), ("seed", "x"), ("seed", 1.5), ("seed", 2 ** 70),
    ("n", 0), ("n", "2"), ("max_gen_len", [5]), ("max_gen_len", 0), ("logits_processors", [3]),
    ("logits_processors", "abc"), ("temperature", -1.0), ("top_p", 0.0), ("seed", [1, 2, 3]),
])
def test_bad_parameters_raise_value_error_naming_them(stories, name, value):
    prompts = [ONCE, LILY]
    dialogs = [[{"role": "user", "content": "Hi"}]] * 2
    with pytest.raises(ValueError, match=name):
        stories.text_completion(prompts, **{name: value})
    with pytest.raises(ValueError, match=name):
        stories.chat_completion(dialogs, **{name: value})
    if name != "n" and not (isinstance(value, list) and name in ("max_gen_len", "seed")):
        with pytest.raises(ValueError, match=name):
            stories.stream_completion(ONCE, **{name: value})  # raised at the call, before any iteration
        with pytest.raises(ValueError, match=name):
            stories.chat_session().send("Hi", **{name: value})


def test_list_valued_parameters_apply_to_every_prompt(stories, goldens):
    """stop and logits_processors are lists by nature: a flat list is for every prompt, a list of lists per prompt."""
    keep = lambda ids, logits: logits
    res = stories.text_completion([ONCE, LILY], temperature=0, max_gen_len=128, stop=["Lily", "box"],
                              logits_processors=[keep])
    once, lily = goldens[ONCE]["generation_text"], goldens[LILY]["generation_text"]
    assert [r["generation"] for r in res] == [once[: once.find("Lily")], lily[: lily.find("box")]]
    res = stories.text_completion([ONCE, LILY], temperature=0, max_gen_len=128, stop=[["Lily"], []])
    assert [r["generation"] for r in res] == [once[: once.find("Lily")], lily]
    with pytest.raises(ValueError, match="stop"):
        stories.text_completion([ONCE, LILY], stop=[["Lily"]])
