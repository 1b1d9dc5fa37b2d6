"""Structured outputs: a grammar (JSON schema, any JSON object, regex or Lark) that constrains sampling.

`Grammar` is the request's constraint as plain data (a SamplingParams field, `grammar=`). For each Request the
RequestBuilder makes a `Matcher`, the grammar's state over one tokenizer: before sampling, the runner masks every
token the grammar forbids (`Matcher.mask`), and `Request.advance` feeds it the sampled token (`Matcher.consume`).
A request whose grammar is complete finishes with "stop"; its text then parses (and validates against the schema).
Otherwise it ends with "length" (or an early stop string) like any other request.

The grammar engine is llguidance (https://github.com/guidance-ai/llguidance): its vocabulary is built from our
tokenizers (sentencepiece pieces, tiktoken ranks or a tokenizer.json's tokens), with no network, once per tokenizer.
"""

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List

import torch

from llama.tokenizers.text import check_text

KINDS = ("json_schema", "json_object", "regex", "lark")
# Compact JSON (no whitespace between tokens): a model can never loop on whitespace forever.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Grammar:
    """kind: json_schema (text = the schema as JSON), json_object, regex or lark."""

    kind: str
    text: str = ""

    @staticmethod
    def json_schema(schema) -> "Grammar":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"grammar: the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"grammar: a JSON schema must be an object, got {type(schema).__name__}")
        return Grammar("json_schema", json.dumps(schema, sort_keys=True)).checked()

    @staticmethod
    def json_object() -> "Grammar":
        return Grammar("json_object")

    @staticmethod
    def regex(pattern: str) -> "Grammar":
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("grammar: a regex must be a non-empty string")
        return Grammar("regex", check_text("grammar: the regex", pattern)).checked()

    @staticmethod
    def lark(text: str) -> "Grammar":
        if not isinstance(text, str) or not text.strip():
            raise ValueError("grammar: a Lark grammar must be a non-empty string")
        return Grammar("lark", check_text("grammar: the Lark grammar", text)).checked()

    @staticmethod
    def coerce(value) -> "Grammar":
        """The `grammar=` keyword: a Grammar, or {"json_schema": schema} / {"json_object": True} / {"regex": r} /
        {"lark": text}, or an OpenAI response_format ({"type": "json_schema", "json_schema": {"schema": ...}})."""
        if isinstance(value, Grammar):
            return value
        if isinstance(value, dict) and "type" in value:
            return Grammar.from_response_format(value)
        if isinstance(value, dict) and len(value) == 1:
            (k, v), = value.items()
            if k == "json_schema":
                return Grammar.json_schema(v)
            if k == "json_object" and v:
                return Grammar.json_object()
            if k == "regex":
                return Grammar.regex(v)
            if k == "lark":
                return Grammar.lark(v)
        raise ValueError("grammar must be a llama.Grammar or one of {'json_schema': schema}, {'json_object': True}, "
                         f"{{'regex': pattern}}, {{'lark': text}}, got {value!r}")

    @staticmethod
    def from_response_format(rf: Dict) -> "Grammar":
        kind = rf.get("type")
        if kind == "json_object" or rf.get("json_object"):
            return Grammar.json_object()
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise ValueError("response_format.json_schema must be an object with a schema")
            return Grammar.json_schema(js.get("schema", {}))
        if "json_schema" in rf and kind is None:
            return Grammar.json_schema(rf["json_schema"])
        raise ValueError(f"unsupported response_format {rf!r}")

    def source(self) -> str:
        """The llguidance grammar definition."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.text)
        raise ValueError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})")

    def checked(self) -> "Grammar":
        from llguidance import LLMatcher

        try:
            err = LLMatcher.validate_grammar(self.source())
        except (ValueError, TypeError) as e:
            err = str(e)
        if err and not err.startswith("WARNING"):
            raise ValueError(f"grammar: invalid {self.kind.replace('_', ' ')}: {err}")
        return self

    def matcher(self, tokenizer, stop_tokens) -> "Matcher":
        return Matcher(self, vocabulary(tokenizer), stop_tokens)


# ------------------------------------------------------------------------------------------------ vocabularies
_VOCABS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_VOCAB_LOCK = threading.Lock()


class Vocabulary:
    """llguidance's LLTokenizer for one of our tokenizers, and the ids that end a generation."""

    def __init__(self, tokenizer):
        import llguidance

        stops = sorted(set(tokenizer.stop_tokens) | {tokenizer.eos_id})
        self.n = tokenizer.n_words
        if hasattr(tokenizer, "special_tokens") and hasattr(tokenizer, "model"):  # tiktoken (Llama 3)
            from llguidance.tiktoken import lltokenizer_from_encoding

            self.lltok = lltokenizer_from_encoding(tokenizer.model, n_vocab=self.n, eos_token=stops)
        else:
            tokens, special = token_bytes(tokenizer)
            newline = tokenizer.encode("\n", bos=False, eos=False)

            class Wrapped:
                # No BOS (Qwen3's tokenizer names none: bos_id -1) is llguidance's None.
                eos_token_id, bos_token_id = tokenizer.eos_id, tokenizer.bos_id if tokenizer.bos_id >= 0 else None
                special_token_ids = special

                def __call__(self, s):
                    if isinstance(s, bytes):
                        s = s.decode("utf-8", errors="replace")
                    # Text in the middle of a generation: no sentencepiece dummy-prefix space. A newline never
                    # merges with what follows, so encoding it first and dropping its tokens removes the prefix.
                    ids = tokenizer.encode("\n" + s, bos=False, eos=False)
                    return ids[len(newline):] if ids[: len(newline)] == newline else tokenizer.encode(s, bos=False,
                                                                                                        eos=False)

            w = Wrapped()
            w.tokens = tokens
            self.lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(w), n_vocab=self.n, eos_token=stops)


def vocabulary(tokenizer) -> Vocabulary:
    with _VOCAB_LOCK:
        v = _VOCABS.get(tokenizer)
        if v is None:
            v = _VOCABS[tokenizer] = Vocabulary(tokenizer)
        return v


def _byte_decoder() -> Dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a tokenizer.json uses for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer):
    """(bytes of every token id, ids of special tokens) for a sentencepiece or tokenizer.json tokenizer."""
    tokens: List[bytes] = []
    special: List[int] = []
    sp = getattr(tokenizer, "sp_model", None)
    pieces = [tokenizer.piece(i) for i in range(tokenizer.n_words)]
    byte_level = sp is None and any("Ġ" in p for p in pieces)
    inverse = _byte_decoder() if byte_level else {}
    specials = set(getattr(tokenizer, "special_ids", {}).values())
    for i, p in enumerate(pieces):
        is_special = (sp is not None and (sp.is_control(i) or sp.is_unknown(i))) or i in specials or p is None
        if is_special:
            special.append(i)
            tokens.append((p or "").encode())
        elif len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
            tokens.append(bytes([int(p[3:5], 16)]))
        elif byte_level and all(c in inverse for c in p):
            tokens.append(bytes(inverse[c] for c in p))
        else:
            tokens.append(p.replace("\u2581", " ").encode())
    return tokens, special


# ------------------------------------------------------------------------------------------------ per request
class Matcher:
    """One request's grammar state: masks its logits row, consumes its sampled tokens."""

    def __init__(self, grammar: Grammar, vocab: Vocabulary, stop_tokens):
        from llguidance import LLMatcher

        self.vocab = vocab
        self.m = LLMatcher(vocab.lltok, grammar.source(), log_level=0)
        if self.m.is_error():
            raise ValueError(f"grammar: {self.m.get_error()}")
        # stop tokens the grammar may end with but this request does not stop on (a text request's <|eot_id|>)
        self._banned = torch.tensor([t for t in vocab.lltok.eos_tokens if t not in stop_tokens], dtype=torch.long)

    def mask(self, row: torch.Tensor) -> None:
        """Set the logit of every token the grammar forbids next to -inf (row: one request's logits, in place)."""
        if self.m.is_error():
            raise ValueError(f"grammar: {self.m.get_error()}")
        allowed = torch.frombuffer(bytearray(self.m.compute_logit_bias()), dtype=torch.uint8)
        n = min(len(allowed), row.shape[-1])
        forbid = torch.ones(row.shape[-1], dtype=torch.bool)
        forbid[:n] = allowed[:n] == 0
        if len(self._banned):
            forbid[self._banned] = True
        row.masked_fill_(forbid.to(row.device), float("-inf"))

    def consume(self, token: int) -> bool:
        """Advance over a sampled token; True once the grammar is complete (nothing but a stop token may follow)."""
        if not self.m.consume_token(token):
            raise ValueError(f"grammar: token {token} was refused: {self.m.get_error()}")
        return self.m.is_stopped()
