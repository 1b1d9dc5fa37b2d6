"""What the example scripts share: which checkpoint to run (the given one, else the default real model, else the
random demo), building the generator, and reporting items that do not fit instead of failing the whole batch."""

import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from llama import settings
from llama.hub import fetch
from llama.hub.demo import DEMO_NOTE, ensure_demo_checkpoint
from llama.formats.gguf_file import find_gguf


def say(text: str) -> None:
    """A one-line note, printed once (by rank 0 under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        print(text, flush=True)


def default_checkpoint() -> Tuple[str, Optional[str], bool]:
    """(ckpt_dir, tokenizer_path, real): the default model, fetched once; the demo when it cannot be fetched or
    LLAMA_OFFLINE=1."""
    if settings.get().offline:
        say(f"LLAMA_OFFLINE is set: not fetching {fetch.NAME}. {DEMO_NOTE}")
    else:
        try:
            path = fetch.fetch_default_model()
            say(fetch.NOTE)
            return str(path), None, True
        except fetch.FetchError as e:
            say(f"Could not fetch {fetch.NAME} ({e}). {DEMO_NOTE}")
    ckpt, tok = ensure_demo_checkpoint()
    return ckpt, tok, False


def resolve_checkpoint(ckpt_dir: Optional[str], tokenizer_path: Optional[str]) -> Tuple[str, Optional[str], bool]:
    """(ckpt_dir, tokenizer_path, is_default_model): the given checkpoint (tokenizer defaulting to its
    tokenizer.model, or to the one a GGUF file embeds), or the default."""
    if ckpt_dir is None:
        if tokenizer_path is not None:
            raise ValueError("--tokenizer_path was given without --ckpt_dir: pass both, or neither for the default "
                             "model")
        ckpt, tok, real = default_checkpoint()
        return ckpt, tok, real
    if tokenizer_path is None and find_gguf(ckpt_dir) is not None:
        return str(ckpt_dir), None, False  # a GGUF file carries its tokenizer
    return str(ckpt_dir), str(tokenizer_path or Path(ckpt_dir) / "tokenizer.model"), False


def build_for_example(ckpt_dir: Optional[str], tokenizer_path: Optional[str], **build_options):
    """(generator, is_default_model): silence ranks other than 0 under torchrun, pick the checkpoint, build."""
    from llama.generation import Llama

    if os.environ.get("RANK", "0") != "0":
        sys.stdout = open(os.devnull, "w")
    ckpt_dir, tokenizer_path, default = resolve_checkpoint(ckpt_dir, tokenizer_path)
    return Llama.build(ckpt_dir=ckpt_dir, tokenizer_path=tokenizer_path, **build_options), default


def misfits(generator, items: Sequence, chat: bool) -> List[Optional[str]]:
    """Per item, None if it fits max_seq_len, else why not: so a batch runs the items that fit."""
    out = []
    for i, item in enumerate(items):
        tokens = (generator.inputs.encode_dialog(item, i)[0] if chat else generator.inputs.encode_text(item))
        if tokens is not None and len(tokens) >= generator.max_seq_len:
            kind = "dialog" if chat else "prompt"
            out.append(f"{kind} {i} has {len(tokens)} tokens, which does not fit max_seq_len={generator.max_seq_len}"
                       " (pass a larger --max_seq_len)")
        else:
            out.append(None)
    return out
