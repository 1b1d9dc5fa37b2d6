"""Seeded sampling: a draw is a pure function of (seed, sample, step), and it samples the filtered distribution."""

import torch

from llama.sample.sampling import sample, seeded_uniform


def _t(*xs):
    return torch.tensor(xs, dtype=torch.long)


def test_seeded_uniform_is_a_pure_function_of_its_inputs():
    seeds, samples, steps = _t(7, 7, 7, 8, -3, 2**62), _t(0, 1, 0, 0, 0, 5), _t(0, 0, 1, 0, 0, 9)
    u = seeded_uniform(seeds, samples, steps)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert len(set(u.tolist())) == 6  # every input differs, so does every draw
    # Alone, or in another order and company, each row draws the same number.
    for i in range(6):
        assert seeded_uniform(seeds[i : i + 1], samples[i : i + 1], steps[i : i + 1]).item() == u[i].item()
    perm = torch.tensor([5, 3, 1, 0, 2, 4])
    assert torch.equal(seeded_uniform(seeds[perm], samples[perm], steps[perm]), u[perm])


def test_seeded_uniform_is_uniform():
    n = 20000
    u = seeded_uniform(torch.full((n,), 123), torch.zeros(n, dtype=torch.long), torch.arange(n))
    assert abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    assert bool((hist - n / 10).abs().max() < 0.05 * n / 10 * 3)


def _probs_logits(p):
    return torch.log(torch.tensor(p, dtype=torch.float32))


def _draws(logits, n, temperature=1.0, top_p=1.0, top_k=0, seed=1):
    rows = logits.expand(n, -1)
    u = seeded_uniform(torch.full((n,), seed), torch.zeros(n, dtype=torch.long), torch.arange(n))
    return sample(rows, torch.full((n,), temperature), torch.full((n,), top_p), torch.full((n,), top_k), u)


def test_seeded_draws_follow_the_distribution():
    p = [0.5, 0.3, 0.15, 0.05]
    got = torch.bincount(_draws(_probs_logits(p)[None], 20000), minlength=4).float() / 20000
    assert torch.allclose(got, torch.tensor(p), atol=0.015)


def test_filters_hold_for_seeded_draws():
    logits = _probs_logits([0.4, 0.3, 0.2, 0.1])[None]
    assert set(_draws(logits, 2000, top_k=2).tolist()) == {0, 1}
    assert set(_draws(logits, 2000, top_p=0.65).tolist()) == {0, 1}  # 0.4 + 0.3 reaches 0.65
    assert set(_draws(logits, 2000, top_k=1).tolist()) == {0}
    assert set(_draws(logits, 50, temperature=0.0).tolist()) == {0}
    # Low temperature sharpens: almost always the top token.
    assert (_draws(logits, 2000, temperature=0.1) == 0).float().mean() > 0.9


def test_rows_are_independent():
    """A seeded row's token does not depend on the other rows' logits, parameters or RNG use."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    temp, top_p, top_k = _f(1.0, 0.0, 0.7, 1.0), _f(0.9, 1.0, 0.5, 1.0), _t(0, 0, 5, 3)
    u = seeded_uniform(_t(1, 2, 3, 4), _t(0, 0, 0, 0), _t(0, 0, 0, 0))
    u[3] = float("nan")  # unseeded row: global RNG
    batch = sample(logits, temp, top_p, top_k, u)
    for i in (0, 2):
        alone = sample(logits[i : i + 1], temp[i : i + 1], top_p[i : i + 1], top_k[i : i + 1], u[i : i + 1])
        assert alone.item() == batch[i].item()
    assert batch[1].item() == logits[1].argmax().item()


def _f(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def test_seeded_draw_ignores_the_sort_order_of_near_equal_tokens():
    """Two tokens whose logits differ only by float rounding (which the batch's shape changes: a matmul over more
    rows, a prompt prefilled in two chunks) sort either way round. The seeded draw must not depend on that order:
    otherwise every draw landing in either token's bin picks the other token, which is how a seeded 256-token reply
    from the server left its offline result (issue 14's load test: logits 10.893055 and 10.893051 at step 78).
    Inverting the CDF in vocabulary order, only a draw within rounding of a bin boundary could still change."""
    torch.manual_seed(0)
    base = torch.randn(64)
    base[3] = base[7] = base.max() + 0.5  # the two most likely tokens, exactly tied
    a, b = base.clone(), base.clone()
    a[7] += 1e-6  # 7 sorts before 3
    b[3] += 1e-6  # 3 sorts before 7
    n = 4000
    u = seeded_uniform(torch.full((n,), 5), torch.zeros(n, dtype=torch.long), torch.arange(n))
    for temperature, top_p, top_k in ((1.0, 1.0, 0), (0.8, 0.95, 0), (0.7, 0.9, 10)):
        args = (torch.full((n,), temperature), torch.full((n,), top_p), torch.full((n,), top_k), u)
        ta, tb = sample(a.expand(n, -1), *args), sample(b.expand(n, -1), *args)
        assert int((ta == 3).sum()) > n // 10 and int((ta == 7).sum()) > n // 10  # both are drawn often
        assert torch.equal(ta, tb)
