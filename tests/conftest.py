"""Shared fixtures: paths into ../shared (skipped with a reason when absent) and one stories260K generator."""

import json
from pathlib import Path

import pytest
import torch

# The test models are tiny: one thread is as fast, and never oversubscribes a shared 2-core machine.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"
GOLDENS = SHARED / "goldens" / "stories260K_greedy.json"
LLAMA2_TOKENIZER = SHARED / "tokenizers" / "llama2" / "tokenizer.model"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found: these tests need ../shared beside the repository")
    return path


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return _need(STORIES)


@pytest.fixture(scope="session")
def goldens() -> dict:
    return json.loads(_need(GOLDENS).read_text())


@pytest.fixture(scope="session")
def llama2_tokenizer_path() -> Path:
    return _need(LLAMA2_TOKENIZER)


@pytest.fixture(scope="session")
def stories(stories_dir):
    """stories260K with room for the goldens' 128 new tokens, batch of 4."""
    from llama import Llama

    return Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=256, max_batch_size=4)
