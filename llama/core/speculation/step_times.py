"""What a decode step of a given number of rows costs on the machine it runs on, for the speculative policy
(llama/core/speculation/speculative.py): t(rows) from the median of the steps measured at each row count, not from a line.

Why a table. How a step's time grows with its rows depends on the model, the kernel and the load: a 135M Q4_1
model on this busy 2-core CPU paid 1.85 one-row steps for 2 rows but 2.5 for 5 (2 threads), and 1.5 to 6.3 for
2 to 8 rows at one thread (our GGUF kernel unpacks each weight block once per row), while a 7B bf16 step is
memory-bound (about 1 for any k). A line through the 1- and 2-row times priced an 8-row verify at 7 steps, so no
long draft was tried. So each row count is its own entry; between measured counts the cost is interpolated (the
medians made non-decreasing by pooling adjacent violators), and past the largest measured count it grows by
PRIOR_SLOPE of a one-row step per row, an optimistic guess that a verify of that size then measures (one step's
worth of learning per row count).
"""

import collections
from typing import Callable, Dict, List, Optional, Set, Tuple

PRIOR_SLOPE = 0.1  # a row's cost, in 1-row steps, past the rows measured (a memory-bound step's)
WINDOW = 9  # steps per row count whose median is t(rows)


class StepTimes:
    """Seconds of a scheduler's decode steps by rows (a Decode op's width, a Verify op's rows): from one plan to
    the next, kept for steps that ran nothing but decoding and whose requests partly still decode in the next (so
    no prefill and no idle wait is counted)."""

    def __init__(self, measure: bool):
        self.measure = measure
        self._seen: Dict[int, collections.deque] = {}
        self._last: Optional[Tuple[float, int, Set[int]]] = None  # (start, rows, request ids) of a decoding step

    def tick(self, now: float, rows: int, ids: Set[int]) -> None:
        """A step begins (now: before its drafting, so a draft model's time is its step's); rows: 0 if it runs
        more than decoding."""
        last, self._last = self._last, None
        if last is not None and not last[2].isdisjoint(ids):
            self.add(last[1], now - last[0])
        if self.measure and rows:
            self._last = (now, rows, ids)

    def skip(self) -> None:
        """Leave the step in flight untimed (it compiled a graph)."""
        self._last = None

    def knows(self, rows: int) -> bool:
        """A step of these rows was timed (or nothing is timed): drafts can be weighed against it."""
        return not self.measure or rows in self._seen

    def add(self, rows: int, seconds: float) -> None:
        self._seen.setdefault(rows, collections.deque(maxlen=WINDOW)).append(seconds)

    def table(self) -> List[Tuple[int, float]]:
        """(rows, seconds) per row count measured, ascending: the medians, made non-decreasing (more rows never
        cost less) by pooling adjacent violators, weighted by their samples (a noisy low median beside a higher
        one is averaged with it, not raised to it, so one slow spell does not price every longer step)."""
        blocks: List[List[float]] = []  # [rows of the block's first count, time, weight, rows of its last count]
        for m in sorted(m for m, v in self._seen.items() if v):
            v = sorted(self._seen[m])
            blocks.append([m, v[len(v) // 2], float(len(v)), m])
            while len(blocks) > 1 and blocks[-2][1] > blocks[-1][1]:
                (m0, t0, w0, _), (_, t1, w1, m1) = blocks[-2], blocks.pop()
                blocks[-1] = [m0, (t0 * w0 + t1 * w1) / (w0 + w1), w0 + w1, m1]
        out: List[Tuple[int, float]] = []
        for m0, t, _, m1 in blocks:
            out += [(m, t) for m in sorted(self._seen) if m0 <= m <= m1 and self._seen[m]]
        return out

    def cost(self) -> Callable[[int], float]:
        """t(rows), in any unit (only ratios are used): measured, interpolated between measured row counts, or
        extrapolated by PRIOR_SLOPE; with nothing measured, 1 + PRIOR_SLOPE per extra row."""
        pts = self.table()
        if not pts:
            return lambda rows: 1 + PRIOR_SLOPE * (rows - 1)
        known = dict(pts)
        slope = PRIOR_SLOPE * pts[0][1] / pts[0][0]

        def t(rows: int) -> float:
            if rows in known:
                return known[rows]
            below = [p for p in pts if p[0] < rows]
            above = [p for p in pts if p[0] > rows]
            if below and above:
                (m0, t0), (m1, t1) = below[-1], above[0]
                return t0 + (t1 - t0) * (rows - m0) / (m1 - m0)
            if above:  # fewer rows than any measured: at most that step's cost
                return above[0][1]
            return below[-1][1] + slope * (rows - below[-1][0])
        return t
