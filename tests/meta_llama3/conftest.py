"""Points Meta's vendored test at the Llama 3 tokenizer in ../shared (its TOKENIZER_PATH), or skips it."""

import os
from pathlib import Path

import pytest
from conftest import SHARED

LLAMA3_TOKENIZER = SHARED / "tokenizers" / "llama3" / "tokenizer.model"


@pytest.fixture(autouse=True)
def tokenizer_path(monkeypatch):
    path = Path(os.environ.get("TOKENIZER_PATH") or LLAMA3_TOKENIZER)
    if not path.is_file():
        pytest.skip(f"{path} not found: Meta's tokenizer test needs the Llama 3 tokenizer in ../shared beside the "
                    "repository (or TOKENIZER_PATH)")
    monkeypatch.setenv("TOKENIZER_PATH", str(path))
    return path
