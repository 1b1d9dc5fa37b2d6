"""Draft-model drafting for speculative decoding (llama/core/speculation/speculative.py): a small model with the target's
tokenizer proposes k tokens, and the target verifies them exactly as it verifies prompt lookup, so the output is
the target's alone, token for token, whatever the draft proposes (a poor draft costs time, never text).

How it drafts. A seeded request's drafted token i is sampled as the target will sample that position: its
temperature, top-p, top-k and logits transforms (the penalties and any registered parameter's, over the tokens
drafted before it: SamplingParams.transform_logits), and the seeded draw of the same (seed, sample, token index)
(llama/sample/sampling.py). The draft is still a pure function of the context, and
where the draft's distribution is close to the target's the two draws land on the same token far more often than
the target's draw lands on the draft's argmax: a model drafting for itself accepts every seeded token. Logits
processors and the grammar are left out (they see accepted prefixes only). Greedy and unseeded requests draft
greedily: an unseeded target draws from the global generator, which the draft cannot foresee, and a draft that is
a function of the context alone keeps the target's distribution (an independent sample would accept less often).

The draft is a second Llama (built by Llama.build(draft_model=...)) whose runner and KV cache this module drives
with plain ops: its cache is its own (KVCache, the one owner of its blocks), row for row the target's rows, each
row holding one full sequence's blocks for good. A row remembers which request it holds and how many of that
request's tokens it has right; a draft first catches up on the tokens since (the prompt by one Prefill, as the
model's prefill computes it, later tokens by decode rows, as the model's verify passes write them), then decodes
k - 1 more tokens one at a time. Tokens it drafted past what was accepted are simply written over next time.
"""

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from llama.core.scheduling.plan import Prefill, SetBlocks, Verify
from llama.sample.sampling import sample, seeded_uniform

CATCH_UP = 64  # most tokens one decode pass catches up on (decode rows: a Verify op's)
STEADY = 8  # most tokens a step catches up on while drafting every step (a verify emits at most MAX_ROWS tokens)


class DraftModel:
    """Drafts for the target's requests from a draft Llama's runner; vocab: the target's vocabulary size."""

    def __init__(self, runner, vocab: int, name: str = "the draft model"):
        if runner.model.vocab_size != vocab:
            raise ValueError(f"{name} has a vocabulary of {runner.model.vocab_size} tokens and the model "
                             f"{vocab}: a draft model must share the model's tokenizer")
        self.runner, self.cache = runner, runner.cache
        self._rows: Dict[int, Tuple[object, int]] = {}  # cache row -> (request, its tokens the row holds right)
        self._ready = False
        self._once = False  # a once-off pass ran since once_off() last asked

    def once_off(self) -> bool:
        """Whether a pass since the last call was a once-off: a prompt, or a catch-up on more tokens than a step
        that drafts emits (drafting had paused). The speculator leaves that step out of the step times it weighs
        drafts by (llama/core/speculation/step_times.py): they would price every row of a verify by how long drafting paused."""
        once, self._once = self._once, False
        return once

    def holds(self, request, row: int) -> bool:
        """Whether row already holds request's prompt (drafting for it needs no prompt pass)."""
        return self._rows.get(row, (None, 0))[0] is request

    def _blocks(self) -> None:
        """Every row its own blocks, once: the pool is this draft's alone and holds max_batch_size full rows."""
        cache = self.cache
        per = cache.pool.blocks_for(cache.max_seq_len)
        blocks = cache.pool.allocate(cache.max_batch_size * per)
        if blocks is None:
            raise ValueError(f"the draft model's KV pool has {cache.pool.available()} free blocks; its "
                             f"{cache.max_batch_size} rows of {cache.max_seq_len} positions need "
                             f"{cache.max_batch_size * per}")
        rows = range(cache.max_batch_size)
        self.runner.execute([SetBlocks(rows=list(rows), blocks=[blocks[i * per : (i + 1) * per] for i in rows])])
        self._ready = True

    def draft(self, request, row: int, prompt: Sequence[int], tokens: Sequence[int], k: int) -> List[int]:
        """k tokens the draft model decodes after tokens (request's prompt + output so far), each picked as the
        request's next tokens will be (see the module's note), in cache row row; the row's earlier work for the
        same request is kept."""
        if k <= 0 or not tokens:
            return []
        if not self._ready:
            self._blocks()
        held, have = self._rows.get(row, (None, 0))
        have = min(have, len(tokens) - 1) if held is request else 0  # at least the last token, for its logits
        self._rows[row] = (request, len(tokens))
        run, logits = self.runner.execute, None
        if have < len(prompt):  # the prompt in one pass, as the model's own prefill computes it
            n, self._once = len(prompt) - have, True
            (logits,) = run([Prefill(tokens=[list(prompt[have:])], start=have, rows=[row], last=[n - 1],
                                     kv_len=len(prompt))])
            have = len(prompt)
        self._once |= len(tokens) - have > STEADY
        while have < len(tokens):
            n = min(CATCH_UP, len(tokens) - have)
            (logits,) = run([Verify(tokens=list(tokens[have : have + n]), pos=list(range(have, have + n)),
                                    rows=[row] * n)])
            have += n
        pick, out = picker(request, len(tokens) - len(prompt)), []
        out.append(pick(logits.reshape(-1, logits.shape[-1])[-1], out))
        for i in range(k - 1):
            (logits,) = run([Verify(tokens=[out[-1]], pos=[len(tokens) + i], rows=[row])])
            out.append(pick(logits[-1], out))
        return out


def picker(request, generated: int) -> Callable[[torch.Tensor, List[int]], int]:
    """pick(logits (V,), drafted so far) -> the next drafted token of request, which has generated tokens: the
    seeded draw of its next token index under its sampling parameters, or the argmax (greedy, unseeded)."""
    p = request.params
    if p.temperature <= 0 or p.seed is None:
        return lambda logits, drafted: int(torch.argmax(logits))
    temperature, top_p, top_k = torch.tensor([p.temperature]), torch.tensor([p.top_p]), torch.tensor([p.top_k])
    seed, which = torch.tensor([p.seed]), torch.tensor([request.sample])
    transformed = bool(p.transforms)

    def pick(logits: torch.Tensor, drafted: List[int]) -> int:
        row = logits[None].clone()
        if transformed:
            p.transform_logits(row[0], request.prompt, list(request.generated) + drafted)
        u = seeded_uniform(seed, which, torch.tensor([generated + len(drafted)])).to(row.device)
        return int(sample(row, temperature.to(row.device), top_p.to(row.device), top_k.to(row.device), u)[0])
    return pick
