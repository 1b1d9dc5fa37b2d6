"""Random-weight checkpoints: the newcomer's demo model, and test/benchmark models of any shape.

The demo lets the example scripts run end to end with no downloaded weights: a tiny random model and a
sentencepiece tokenizer trained on a short text shipped in the package. Its output is meaningless by design.
"""

import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from llama import settings
from llama.formats.meta_checkpoint import expected_shapes, save_checkpoint
from llama.model import ModelArgs

DEMO_PARAMS = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "norm_eps": 1e-5,
               "vocab_size": 2048}
CORPUS = Path(__file__).resolve().parents[1] / "data" / "demo_corpus.txt"
DEMO_NOTE = ("Using the demo checkpoint: random weights, so its text is meaningless. "
             "See README.md (and docs/checkpoints.md) to run a real model.")


def random_state_dict(args: ModelArgs, seed: int = 0, std: Optional[float] = None,
                      dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """Full (unsharded) Meta-layout weights on CPU, norms at 1; drawn in fp32 and cast tensor by tensor, so a
    7B-shaped bf16 state never holds an fp32 copy of the whole model.

    std None scales each matrix by 1/sqrt(fan_in) (embeddings N(0, 1)) so activations and logits stay in a
    realistic range at any size; otherwise every matrix is N(0, std).
    """
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_shapes(args).items():
        if len(shape) == 1:
            state[name] = torch.ones(shape, dtype=dtype)
        else:
            scale = std if std is not None else (1.0 if name == "tok_embeddings.weight" else shape[1] ** -0.5)
            state[name] = (torch.randn(shape, generator=g) * scale).to(dtype)
    return state


def write_random_checkpoint(out_dir, params: dict, tokenizer_path=None, seed: int = 0, shards: int = 1,
                            dtype: torch.dtype = torch.float32, std: Optional[float] = None) -> Path:
    """A Meta-layout checkpoint of random weights (params.json, consolidated.XX.pth, checklist.chk, and a copy
    of the tokenizer when given): the compute of a real model of that shape, with no download."""
    args = ModelArgs.from_params(params)
    state = random_state_dict(args, seed, std, dtype)
    extra = {"tokenizer.model": Path(tokenizer_path)} if tokenizer_path else None
    save_checkpoint(state, params, out_dir, shards=shards, extra_files=extra)
    return Path(out_dir)


def train_demo_tokenizer(path, vocab_size: int = DEMO_PARAMS["vocab_size"]) -> Path:
    """A byte-fallback BPE sentencepiece model trained on the shipped demo text (deterministic, < 1 s)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(CORPUS), model_writer=buf, vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        split_digits=True, num_threads=1, minloglevel=2,
    )
    Path(path).write_bytes(buf.getvalue())
    return Path(path)


def demo_dir() -> Path:
    return settings.cache_dir() / "demo"


def ensure_demo_checkpoint(target: Optional[Path] = None) -> Tuple[str, str]:
    """Build the demo checkpoint once (cached) and return (ckpt_dir, tokenizer_path).

    Built in a temporary directory and renamed into place, so concurrent ranks under torchrun never see a
    half-written checkpoint.
    """
    target = Path(target) if target is not None else demo_dir()
    if not (target / "checklist.chk").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
        try:
            tok = train_demo_tokenizer(tmp / "source.model")
            write_random_checkpoint(tmp, DEMO_PARAMS, tokenizer_path=tok, seed=0)
            (tmp / "source.model").unlink()
            try:
                os.rename(tmp, target)
            except OSError:  # another process finished first
                if not (target / "checklist.chk").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target), str(target / "tokenizer.model")
