"""Text a tokenizer can take: valid Unicode that encodes as UTF-8. A lone surrogate ("\\ud800", legal in JSON and
in a Python str) is neither, and reached sentencepiece or tiktoken as an error from deep inside them."""


def check_text(name: str, text: str) -> str:
    """text, or ValueError naming the field and the first character UTF-8 cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise ValueError(f"{name} is not valid text: character {e.start} is U+{ord(bad):04X}, an unpaired "
                         "surrogate that UTF-8 cannot encode (send whole characters)") from None
    return text
