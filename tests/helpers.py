"""Shared test helpers: prompts of stories260K's goldens, and processors that pin a model's output."""

ONCE = "Once upon a time"
LILY = "Lily and Ben went to the park"
REPLACEMENT = "\ufffd"
SAMPLED = dict(temperature=1.0, top_p=1.0, max_gen_len=48)


def forcing(seq, eos_id):
    """A logits processor that forces `seq`, then EOS: makes a random model's output fully determined."""
    import torch

    def proc(ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[seq[len(ids)] if len(ids) < len(seq) else eos_id] = 0.0
        return out
    return proc


def continuation(tok, context, generated):
    """Text the generated tokens add after the context: what completion and streaming must both return."""
    return tok.decode(context + generated)[len(tok.decode(context)):]


def check_stream(deltas, final):
    assert "".join(deltas) == final
    if REPLACEMENT not in final:
        assert not any(REPLACEMENT in d for d in deltas), deltas


def build_stories(max_batch_size=4, max_seq_len=256):
    """A fresh stories260K generator (for tests that need other cache sizes than conftest's `stories`)."""
    from conftest import STORIES, need
    from llama import Llama

    need(STORIES / "consolidated.00.pth")
    return Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=max_seq_len,
                       max_batch_size=max_batch_size)
