"""A reasoning model's think block on /v1/chat/completions: `reasoning_content` beside `content` in the message,
and streamed as `delta.reasoning_content` chunks before the content's (as vLLM and llama.cpp's server do). Only
for models whose chat template knows </think>; the split itself is llama/tokenizers/reasoning.py."""

from typing import Dict, List, Optional, Tuple

from llama.serve import protocol
from llama.tokenizers import reasoning


def applies(spec, generator) -> bool:
    return spec.chat and reasoning.reasons(generator.formatter)


def streams(spec, reqs, generator) -> Optional[List[reasoning.ReasoningStream]]:
    """One splitter per request of a reasoning model's chat stream, else None (the stream passes text through)."""
    if not applies(spec, generator):
        return None
    return [reasoning.ReasoningStream(reasoning.prompt_opens_think(generator.tokenizer, r.prompt)) for r in reqs]


def deltas(spec, index: int, parts: Tuple[str, str]) -> List[Dict]:
    """The chunks' choices for one (reasoning, content) delta pair: reasoning first, empty parts left out."""
    thought, content = parts
    out = []
    if thought:
        out.append({"index": index, "delta": {"reasoning_content": thought}, "logprobs": None, "finish_reason": None})
    if content:
        out.append(protocol.delta_choice(spec, index, content))
    return out


def apply_whole(spec, reqs, response: Dict, generator) -> None:
    """Split each choice's message of a whole chat response (in place)."""
    if not applies(spec, generator):
        return
    for choice, r in zip(response["choices"], reqs):
        message = choice["message"]
        thought, content = reasoning.split(message["content"],
                                           reasoning.prompt_opens_think(generator.tokenizer, r.prompt))
        if thought is not None:
            message["reasoning_content"], message["content"] = thought, content
