"""/tokenize and /detokenize, in the shapes llama.cpp's server and vLLM's use, so tools written for either work:
text in "content" (llama.cpp) or "prompt" (vLLM), or a chat in "messages" (rendered with the model's template and
its generation prompt); token ids out in "tokens", with vLLM's "count" and "max_model_len"."""

import numbers
from typing import Dict

from llama.serve.protocol import APIError, bad


def tokenize(gen, body: Dict) -> Dict:
    """Token ids of the text or chat in body, as the server would feed them to the model."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    special = body.get("add_special", body.get("add_special_tokens", True))
    if not isinstance(special, bool):
        raise bad("add_special_tokens", "add_special_tokens must be true or false")
    try:
        if "messages" in body:
            tokens, _ = gen.inputs.encode_dialog(body["messages"])
            if tokens is None:
                raise bad("messages", "the chat format refuses this dialog")
        else:
            field = "content" if "content" in body else "prompt"
            text = body.get(field)
            if not isinstance(text, str):
                raise bad(field, f"{field} must be a string (or send messages)")
            tokens = gen.tokenizer.encode(text, bos=special, eos=False)
    except ValueError as e:  # an unencodable text or a malformed dialog, named by the check
        raise bad("messages" if "messages" in body else "content", str(e)) from None
    out = {"tokens": tokens, "count": len(tokens), "max_model_len": gen.max_seq_len}
    if body.get("with_pieces"):
        out["pieces"] = [gen.tokenizer.decode([t]) for t in tokens]
    return out


def detokenize(gen, body: Dict) -> Dict:
    """The text of body["tokens"] (ids in the vocabulary)."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                               for t in tokens):
        raise bad("tokens", "tokens must be a list of token ids (integers)")
    vocab = gen.model.vocab_size
    outside = [t for t in tokens if not 0 <= t < vocab]
    if outside:
        raise bad("tokens", f"token id {outside[0]} is outside the vocabulary [0, {vocab})")
    text = gen.tokenizer.decode([int(t) for t in tokens])
    return {"content": text, "prompt": text}
