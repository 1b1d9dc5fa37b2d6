"""Token sampling: the reference's temperature + top-p, plus top-k and seeded draws independent of batching.

A seeded draw for generated token t of sample j of a request with seed s is a pure function of (s, j, t): a
counter-based hash (splitmix64) turned into a uniform number, then inverted through the filtered distribution (in
vocabulary order). No generator state is shared between rows, so a request gives the same text alone, in any
batch, at any max_batch_size and on every model-parallel rank, up to float rounding: the logits themselves differ
in their last bits with the batch's shape, which changes a draw only where it falls within that rounding of the
boundary between two tokens' bins.
"""

import math
from typing import List, Optional, Sequence, Tuple

import torch

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """A uint64 constant as the int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN  # int64 arithmetic wraps like uint64
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def seeded_uniform(seed: torch.Tensor, sample: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Uniform float64 in [0, 1) per row, a pure function of (seed, sample, step) (int64 tensors)."""
    h = _splitmix64(_splitmix64(_splitmix64(seed.long()) ^ sample.long()) ^ step.long())
    return _shr(h, 11).double() * (1.0 / (1 << 53))


def sample_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """The reference's nucleus sampling with the global RNG: (B, V) probabilities -> (B, 1) token ids."""
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    probs_sort[probs_sum - probs_sort > p] = 0.0
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
    return torch.gather(probs_idx, -1, torch.multinomial(probs_sort, num_samples=1))


def index(values: Sequence[int], device) -> torch.Tensor:
    """An index tensor on `device` without a host synchronisation: on CUDA a plain copy from pageable memory waits for
    every kernel already queued, which would stall asynchronous decoding (llama/core/worker/ahead.py)."""
    t = torch.tensor(list(values), dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: Optional[torch.Tensor] = None,
    uniform: Optional[torch.Tensor] = None,
    rows: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Next token per row of logits (B, V), with per-row parameters (tensors of shape (B,)).

    temperature 0 means greedy. top_k 0 means no top-k cut. uniform: the seeded draw per row, NaN for rows that
    use the global RNG (torch.multinomial, the reference's behaviour). rows: (sampled rows, those of them that draw
    from the global RNG, those that are seeded) as index tensors, when the caller knows them (RowSampler): then
    nothing here waits for the device; else they are read from temperature and uniform.
    """
    greedy = logits.argmax(dim=-1)
    if rows is None:
        sampled = temperature > 0
        if not bool(sampled.any()):
            return greedy
        hot = sampled.nonzero().squeeze(1)
        seeded = ~torch.isnan(uniform[hot]) if uniform is not None else torch.zeros_like(hot, dtype=torch.bool)
        rows = (hot, (~seeded).nonzero().squeeze(1), seeded.nonzero().squeeze(1))
    hot, free, seeded = rows
    if not len(hot):
        return greedy
    probs = torch.softmax(logits[hot].float() / temperature[hot, None].float(), dim=-1)
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    cut = probs_sort.cumsum(dim=-1) - probs_sort > top_p[hot, None]
    if top_k is not None:
        k = top_k[hot, None]
        cut |= (torch.arange(probs.shape[-1], device=probs.device)[None] >= k) & (k > 0)
    probs_sort.masked_fill_(cut, 0.0)
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))

    token = torch.empty(len(hot), dtype=torch.long, device=logits.device)
    if len(free):
        choice = torch.multinomial(probs_sort[free], num_samples=1)
        token[free] = torch.gather(probs_idx[free], -1, choice).squeeze(1)
    if len(seeded):
        # The draw inverts the filtered distribution in vocabulary order, not in sorted order: two tokens whose
        # probabilities differ only by float rounding (which the batch's shape changes) may sort either way, and
        # in sorted order a draw anywhere in their two bins would then pick the other token. In vocabulary order
        # only a draw within rounding of a bin boundary can change.
        kept = torch.zeros_like(probs_sort[seeded]).scatter_(-1, probs_idx[seeded], probs_sort[seeded])
        cdf = kept.double().cumsum(dim=-1)
        target = uniform[hot][seeded].to(cdf)[:, None] * cdf[:, -1:]
        picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
        # Never pick a token the filters removed (guards the last bin against rounding).
        last_kept = kept.shape[-1] - 1 - (kept > 0).flip(-1).int().argmax(dim=-1)
        token[seeded] = torch.minimum(picked, last_kept)
    out = greedy.clone()
    out[hot] = token
    return out


def top_entries(logprobs: torch.Tensor, ks: Sequence[int]) -> List[Optional[List[Tuple[int, float]]]]:
    """Row b's ks[b] most likely (token id, log-probability) pairs from log-probabilities (B, V), best first; None
    where ks[b] is 0. Tokens a grammar or processor ruled out (-inf) are left out: they are not alternatives."""
    k = max(ks, default=0)
    if k == 0:
        return [None] * len(ks)
    vals, idx = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    vals, idx = vals.tolist(), idx.tolist()
    return [[(i, v) for i, v in zip(idx[b][:kb], vals[b][:kb]) if math.isfinite(v)] if kb else None
            for b, kb in enumerate(ks)]


def prompt_top_entries(logits: torch.Tensor, tokens: List[int], k: int) -> List[List[Tuple[int, float]]]:
    """The k most likely tokens at each of the len(tokens) - 1 positions token_logprobs scores."""
    lps = torch.log_softmax(logits[: len(tokens) - 1].float(), dim=-1)
    return top_entries(lps, [k] * lps.shape[0])


def token_logprobs(logits: torch.Tensor, tokens: List[int]) -> List[float]:
    """log p(tokens[i+1] | tokens[:i+1]) from the logits (T, V) at tokens' positions: T-1 values."""
    target = torch.tensor(tokens[1:], device=logits.device)
    return torch.log_softmax(logits[: len(tokens) - 1].float(), dim=-1).gather(1, target[:, None])[:, 0].tolist()


def penalize(row: torch.Tensor, prompt: Sequence[int], generated: Sequence[int], presence: float = 0.0,
             frequency: float = 0.0, repetition: float = 1.0) -> torch.Tensor:
    """One request's logits row (V,) with its penalties applied in place: repetition as transformers' and vLLM's
    (a seen token's logit divided by the penalty if positive, multiplied if negative; seen = prompt + generated),
    then OpenAI's presence and frequency (logit -= count * frequency + (count > 0) * presence over the generated
    tokens). A function of the row and the request's own tokens only, so batching cannot change it."""
    if repetition != 1:
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long, device=row.device)
        if len(seen):
            vals = row[seen]
            row[seen] = torch.where(vals < 0, vals * repetition, vals / repetition)
    if (presence or frequency) and len(generated):
        ids, counts = torch.tensor(list(generated), dtype=torch.long).unique(return_counts=True)
        ids, counts = ids.to(row.device), counts.to(row.device, torch.float32)
        row[ids] = (row[ids].float() - counts * frequency - presence).to(row.dtype)
    return row


class RowSampler:
    """Draws one token per row for a fixed list of rows (anything with .params, .sample and .generated), with
    their parameters turned into tensors once rather than at every step."""

    def __init__(self, rows: Sequence, device):
        self.rows = rows
        self.device = device
        self.temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        self.top_p = torch.tensor([r.params.top_p for r in rows], device=device)
        self.top_k = torch.tensor([r.params.top_k for r in rows], device=device)
        self.seeded = torch.tensor([r.params.seed is not None for r in rows])
        self.any_seeded = bool(self.seeded.any())
        self.seeds = torch.tensor([r.params.seed or 0 for r in rows])
        self.samples = torch.tensor([r.sample for r in rows])
        self.want_logprobs = any(r.params.logprobs for r in rows)
        self.top_ks = [r.params.top_logprobs for r in rows]
        self.want_top = any(self.top_ks)
        self.transformed = [b for b, r in enumerate(rows) if r.params.transforms]  # penalties, registered ones
        hot = [b for b, r in enumerate(rows) if r.params.temperature > 0]
        seeded = [k for k, b in enumerate(hot) if rows[b].params.seed is not None]
        free = [k for k, b in enumerate(hot) if rows[b].params.seed is None]
        self.index = tuple(index(x, device) for x in (hot, free, seeded))

    def __call__(self, logits: torch.Tensor) -> Tuple[List[int], Optional[List[float]], Optional[List]]:
        """(token per row, its log-probability under the raw logits or None when no row asked for them, each row's
        top_logprobs alternatives or None when no row asked for them)."""
        for b in self.transformed:
            r = self.rows[b]
            r.params.transform_logits(logits[b], r.prompt, r.generated)
        tokens, lsm = self.draw(logits)
        logprobs = tops = None
        if lsm is not None:
            logprobs = lsm.gather(1, tokens[:, None])[:, 0].tolist()
            if self.want_top:
                tops = top_entries(lsm, self.top_ks)
        return tokens.tolist(), logprobs, tops

    def draw(self, logits: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(token per row, the log-softmax of the logits or None when no row asked for log-probabilities), on the
        device and without waiting for it (logits transforms such as penalties, which read the host's token lists,
        are the caller's)."""
        uniform = None
        if self.any_seeded:  # the draw of generated token t of sample j depends on (seed, j, t) only
            u = seeded_uniform(self.seeds, self.samples, torch.tensor([len(r.generated) for r in self.rows]))
            u = torch.where(self.seeded, u, torch.full_like(u, float("nan")))
            uniform = u.pin_memory().to(self.device, non_blocking=True) if self.index[0].is_cuda else u.to(self.device)
        tokens = sample(logits, self.temperature, self.top_p, self.top_k, uniform, rows=self.index)
        return tokens, torch.log_softmax(logits, dim=-1) if self.want_logprobs else None
