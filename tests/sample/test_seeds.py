"""Seeded sampling and n samples: a request's text is a function of its seed, whatever the batch, the
max_batch_size or the path; n samples are prompt-major and prefilled once."""



from helpers import LILY, ONCE, SAMPLED, build_stories

# --------------------------------------------------------------------------------------------- seeds, n


def test_seed_independent_of_batch_and_max_batch_size(stories):
    alone = stories.text_completion([LILY], seed=7, **SAMPLED)[0]["generation"]
    batch = stories.text_completion([ONCE, LILY, "The cat", "A"], seed=[None, 7, 3, 4], **SAMPLED)
    assert batch[1]["generation"] == alone
    assert len({r["generation"] for r in batch[1:]}) == 3  # other seeds give other texts
    g1, g3 = build_stories(max_batch_size=1), build_stories(max_batch_size=3)
    assert g1.text_completion([LILY], seed=7, **SAMPLED)[0]["generation"] == alone
    # Fourth of five prompts with max_batch_size 3: runs in the second sub-batch, beside a different prompt.
    res = g3.text_completion(["x", "y z w", "q", LILY, ONCE], seed=7, **SAMPLED)
    assert res[3]["generation"] == alone
    # And through streaming.
    assert "".join(g3.stream_completion(LILY, seed=7, **SAMPLED)) == alone


def test_seed_in_chat(stories):
    dialog = [{"role": "user", "content": "Tell me a story."}]
    other = [{"role": "user", "content": "Who is Ben?"}]
    alone = stories.chat_completion([dialog], seed=9, **SAMPLED)[0]["generation"]["content"]
    batch = stories.chat_completion([other, dialog], seed=[1, 9], **SAMPLED)
    assert batch[1]["generation"]["content"] == alone


def test_n_samples_prompt_major_and_reproducible(stories):
    n = 3
    res = stories.text_completion([ONCE, LILY], n=n, seed=5, **SAMPLED)
    assert len(res) == 2 * n
    assert res == stories.text_completion([ONCE, LILY], n=n, seed=5, **SAMPLED)
    # Sample 0 of prompt i is what prompt i alone gives with that seed: so result[i * n + j] is prompt-major.
    assert res[0]["generation"] == stories.text_completion([ONCE], seed=5, **SAMPLED)[0]["generation"]
    assert res[n]["generation"] == stories.text_completion([LILY], seed=5, **SAMPLED)[0]["generation"]
    for i in range(2):
        assert len({r["generation"] for r in res[i * n : (i + 1) * n]}) == n  # samples differ at temperature 1
    # More rows than max_batch_size: samples split over sub-batches still give the same texts.
    g2 = build_stories(max_batch_size=2)
    assert g2.text_completion([ONCE, LILY], n=n, seed=5, **SAMPLED) == res
    # Chat: prompt-major too.
    dialogs = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "A dog?"}]]
    chat = stories.chat_completion(dialogs, n=2, seed=4, **SAMPLED)
    assert chat[2]["generation"] == stories.chat_completion(dialogs[1:], seed=4, **SAMPLED)[0]["generation"]


def test_n_samples_prefill_once(stories):
    shapes = []
    hook = stories.model.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    try:
        res = stories.text_completion([ONCE], n=4, temperature=1.0, max_gen_len=6)
    finally:
        hook.remove()
    assert len(res) == 4
    prompt_len = len(stories.tokenizer.encode(ONCE, bos=True, eos=False))
    assert shapes[0] == (1, prompt_len)  # one prefill row, copied to the other three
    assert all(s == (4, 1) for s in shapes[1:])


def test_max_gen_len_per_prompt(stories):
    res = stories.text_completion([ONCE, LILY, ONCE], temperature=0, max_gen_len=[3, 9, 1], logprobs=True)
    assert [len(r["tokens"]) for r in res] == [3, 9, 1]
    ids = [3, 9, 1]
    out = stories.chat_completion([[{"role": "user", "content": "Hi"}]] * 3, temperature=0, max_gen_len=ids,
                              logprobs=True)
    assert [len(r["tokens"]) for r in out] == ids
