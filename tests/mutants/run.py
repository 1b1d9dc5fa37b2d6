"""Shows that each tightened check fails when its feature is switched off or broken (issue 49): for every
(mutant, test) pair below, runs the test with that mutant (tests/mutants/sitecustomize.py) and reports whether it
failed, as it must. `python tests/mutants/run.py` runs them all (a few minutes on 2 cores); `--only NAME` runs
one mutant; `--baseline` first runs the same tests unbroken, which must pass."""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

CASES = {
    "no_drafts": ["tests/core/speculation/test_speculative.py::test_greedy_and_seeded_outputs_are_identical",
                  "tests/core/speculation/test_speculative.py::test_the_cache_end",
                  "tests/core/speculation/test_speculative.py::test_the_server_flag_and_metrics",
                  "tests/core/speculation/test_draft_model.py::test_outputs_with_another_draft_are_the_outputs_without",
                  "tests/core/speculation/test_draft_model.py::test_the_cache_end",
                  "tests/core/speculation/test_speculative_paging.py"],
    "no_prefix_hits": ["tests/core/scheduling/test_prefix_cache.py::test_concurrent_engine_requests_equal_their_solo_text",
                       "tests/core/speculation/test_speculative_paging.py"],
    "publish_rejected": ["tests/core/speculation/test_speculative_paging.py::test_no_rejected_draft_is_published"],
    # (whether the server test's concurrent requests are preempted depends on thread timing: not listed here)
    "resume_without_output": ["tests/core/speculation/test_speculative_paging.py"],
    "wrong_block": [
        "tests/core/scheduling/test_prefix_cache.py::test_server_reports_cached_tokens_and_the_pool_and_answers_every_request",
        "tests/core/scheduling/test_prefix_cache.py::test_concurrent_engine_requests_equal_their_solo_text",
        "tests/core/speculation/test_speculative_paging.py"],
    "named_choice_parallel": ["tests/serve/test_serve_tools.py::test_named_choice_returns_exactly_one_call"],
}


def run(test: str, mutant: str) -> bool:
    """Whether the test passed."""
    env = {**os.environ, "LLAMA_MUTANT": mutant,
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE) if mutant else "", str(REPO),
                                                      os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                           test], cwd=REPO, env=env, capture_output=True, text=True)
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    reason = next((line for line in proc.stdout.splitlines() if line.startswith("E ")), "")
    print(f"  {'passed' if proc.returncode == 0 else 'FAILED'}: {test}  [{last[0]}] {reason[:160]}", flush=True)
    return proc.returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=sorted(CASES))
    ap.add_argument("--baseline", action="store_true")
    args = ap.parse_args()
    cases = {args.only: CASES[args.only]} if args.only else CASES
    bad = []
    if args.baseline:
        print("baseline (no mutant): every test must pass")
        bad += [("baseline", t) for t in sorted({t for ts in cases.values() for t in ts}) if not run(t, "")]
    for mutant, tests in cases.items():
        start = time.monotonic()
        print(f"mutant {mutant}: every test must fail")
        bad += [(mutant, t) for t in tests if run(t, mutant)]
        print(f"  ({time.monotonic() - start:.0f} s)")
    print("all as expected" if not bad else f"NOT as expected: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
