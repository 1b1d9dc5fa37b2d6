"""The batch CLI on stories260K: results equal running each request alone, bad lines become error rows without
stopping the run, and a run killed mid-way then restarted equals an uninterrupted one (same ids, same texts, no
duplicates), including a truncated last line left by the kill."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, rank_env

STORIES = REPO.parent / "shared" / "models" / "stories260K"
MODEL_ARGS = ["--ckpt_dir", str(STORIES), "--tokenizer_path", str(STORIES / "tokenizer.model"),
              "--max_seq_len", "192", "--max_batch_size", "4", "--threads", "1", "--no_progress"]
STARTS = ["Once upon a time", "Lily and her mom", "The little dog", "One day, Tom saw", "There was a big tree",
          "Sam liked to play", "The sun was hot", "A bird sat on"]


@pytest.fixture(autouse=True)
def need_model():
    if not (STORIES / "consolidated.00.pth").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (expected <repo root>/../shared)")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # main(--threads 1) changes it for the whole process


def run_main(*args):
    from llama.cli.batch import main

    assert main([*MODEL_ARGS, *args]) == 0


def read_rows(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path: Path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def test_results_match_alone_and_bad_lines_become_error_rows(tmp_path):
    from llama import Llama
    from llama.cli.batch import row_seed

    lines = [
        {"id": "a", "prompt": "Once upon a time", "temperature": 0, "max_gen_len": 20},
        {"id": 2, "prompt": "The little dog", "max_gen_len": 15, "stop": ["."]},
        '{"id": "broken", "prompt": ',  # line 3: not JSON
        {"prompt": "no id"},  # line 4
        {"id": "a", "prompt": "duplicate"},  # line 5
        {"id": "hot", "prompt": "Lily", "temperature": -1},  # line 6: bad parameter
        {"id": "long", "prompt": "word " * 300},  # line 7: cannot fit
        {"id": "both", "prompt": "x", "dialog": []},  # line 8
        {"id": "colour", "prompt": "x", "colour": "red"},  # line 9
        "",
        {"id": "chat", "dialog": [{"role": "user", "content": "Tell me a story"}], "max_gen_len": 12, "seed": 5},
    ]
    write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    run_main("--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--temperature", "0.7")
    rows = read_rows(out)
    assert len(rows) == 10  # every non-blank line, exactly once
    by_line = {r["line"]: r for r in rows}
    assert sorted(by_line) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11]
    errors = {n: r["error"] for n, r in by_line.items() if "error" in r}
    assert sorted(errors) == [3, 4, 5, 6, 7, 8, 9]
    assert "not valid JSON" in errors[3] and by_line[3]["id"] is None
    assert '"id"' in errors[4] and by_line[4]["id"] is None
    assert "repeats id 'a'" in errors[5] and by_line[5]["id"] is None
    assert "temperature" in errors[6] and by_line[6]["id"] == "hot"
    assert "max_seq_len=192" in errors[7] and by_line[7]["id"] == "long"
    assert "exactly one" in errors[8]
    assert "colour" in errors[9]

    g = Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=192, max_batch_size=4)
    assert by_line[1]["generation"] == g.text_completion(["Once upon a time"], temperature=0, max_gen_len=20)[0]["generation"]
    expected = g.text_completion(["The little dog"], temperature=0.7, max_gen_len=15, stop=["."], seed=row_seed(0, 2))
    assert by_line[2]["generation"] == expected[0]["generation"] and by_line[2]["finish_reason"] in ("stop", "length")
    chat = g.chat_completion([lines[-1]["dialog"]], temperature=0.7, max_gen_len=12, seed=5)[0]
    assert by_line[11]["generation"] == chat["generation"]
    assert by_line[11]["num_tokens"] <= 12


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    requests = [{"id": f"r{i}", "prompt": STARTS[i % len(STARTS)] + " " * (i // len(STARTS))} for i in range(40)]
    requests.insert(7, "{not json")
    write_jsonl(tmp_path / "in.jsonl", requests)
    args = ["--input", str(tmp_path / "in.jsonl"), "--temperature", "0.8", "--max_gen_len", "150", "--seed", "3"]

    full = tmp_path / "full.jsonl"
    run_main(*args, "--output", str(full))

    resumed = tmp_path / "resumed.jsonl"
    env = rank_env(1)
    proc = subprocess.Popen([sys.executable, "-m", "llama.batch", *MODEL_ARGS, *args, "--output", str(resumed)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if resumed.exists() and resumed.read_text().count("\n") >= 4:
                break
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    partial = read_rows(resumed)
    assert 4 <= len(partial) < len(requests), "the run should have been killed mid-way"
    with open(resumed, "a") as f:
        f.write('{"id": "r39", "generation": "half a ro')  # a row cut short by the kill

    run_main(*args, "--output", str(resumed))
    got, want = read_rows(resumed), read_rows(full)
    assert got[: len(partial)] == partial  # nothing already written was touched
    keys = [r["id"] if r["id"] is not None else r["line"] for r in got]
    assert len(keys) == len(set(keys)) == len(requests)  # no duplicates, nothing lost
    assert sorted(got, key=lambda r: r["line"]) == sorted(want, key=lambda r: r["line"])


def test_model_parallel_run_matches_single_process(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p, "temperature": 0} for i, p in enumerate(STARTS)])
    args = ["--input", str(tmp_path / "in.jsonl"), "--max_gen_len", "20"]
    run_main(*args, "--output", str(tmp_path / "single.jsonl"))
    env = rank_env(2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "llama.batch",
           *MODEL_ARGS, *args, "--output", str(tmp_path / "mp.jsonl")]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in 180 s: {err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    single = sorted(read_rows(tmp_path / "single.jsonl"), key=lambda r: r["id"])
    mp = sorted(read_rows(tmp_path / "mp.jsonl"), key=lambda r: r["id"])
    assert [r["id"] for r in mp] == list(range(len(STARTS)))  # only rank 0 wrote, once per id
    assert [r["generation"] for r in mp] == [r["generation"] for r in single]


SYSTEM = ("You are a storyteller who tells short, happy stories about animals in a park, with a cat, a dog and a "
          "little bird who are friends.")


def test_prefix_cache_on_and_off_write_the_same_rows_and_on_reuses_the_shared_start(tmp_path, capsys):
    """Prompts sharing a 2-block start, greedy and seeded: the same rows with --prefix_cache on and off, and the run
    with it on took part of the later prompts from the cache (the summary line counts the reused tokens)."""
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"{SYSTEM} {s}", **({"temperature": 0} if i % 2 else {})}
                                        for i, s in enumerate(STARTS)])
    rows, reused = {}, {}
    for mode in ("on", "off"):
        run_main("--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / f"{mode}.jsonl"),
                 "--max_gen_len", "24", "--temperature", "0.8", "--prefix_cache", mode)
        found = re.search(r"prefix cache: (\d+) of (\d+) prompt tokens reused", capsys.readouterr().err)
        reused[mode] = (int(found[1]), int(found[2]))
        rows[mode] = sorted(read_rows(tmp_path / f"{mode}.jsonl"), key=lambda r: r["id"])
    assert [r["id"] for r in rows["on"]] == list(range(len(STARTS))) and all("error" not in r for r in rows["on"])
    assert rows["on"] == rows["off"]
    assert reused["on"][0] >= 32 and reused["off"] == (0, 0)
