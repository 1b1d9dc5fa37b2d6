"""Real models' chat templates (llama.cpp's models/templates/, each from the model's tokenizer_config.json, in
llama-cpp-python's sdist that tests/peers.py unpacks at install) rendered by our TemplateChatFormat against
transformers' apply_chat_template on the same template, text and token for token, and the reasoning split
of their replies (llama/tokenizers/reasoning.py)."""

import random
import warnings

import peers
import pytest
from vocab_gguf import llama_cpp_files

from llama.formats.gguf_file import open_reader
from llama.tokenizers import huggingface
from llama.tokenizers import reasoning
from llama.tokenizers.chat_format import (TemplateChatFormat, chat_format_for, check_template_kwargs,
                                          with_template_kwargs)
from llama.tokenizers.tool_format import ToolDialog

transformers = pytest.importorskip("transformers")
DIALOG = [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "What is 12345 + 1?"},
          {"role": "assistant", "content": "<think>\nAdd one to the last digit.\n</think>\n\n12346"},
          {"role": "user", "content": "And  times 2? Answer in 中文."}]
CASES = [("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "llama-bpe", True),
         ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "qwen2", False),
         ("Qwen-Qwen2.5-7B-Instruct", "qwen2", False),
         ("Qwen-Qwen3-0.6B", "qwen2", False)]


@pytest.fixture(scope="module")
def vocab():
    root, done = llama_cpp_files(), {}

    def get(name):
        if name not in done:
            path = root / "models" / f"ggml-vocab-{name}.gguf"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                done[name] = huggingface.from_gguf(open_reader(path), path)
        return done[name]
    return get


@pytest.mark.parametrize("template, vocab_name, opens_think", CASES)
def test_our_rendering_equals_transformers_apply_chat_template(vocab, template, vocab_name, opens_think):
    from tokenizers import Tokenizer

    source = peers.template(f"{template}.jinja")
    tok = vocab(vocab_name)
    tok.chat_template = source  # as a GGUF or tokenizer_config.json carries it
    fmt = chat_format_for(tok)
    assert isinstance(fmt, TemplateChatFormat)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.tok.to_str()))
    kw = dict(bos_token=tok.piece(tok.bos_id), eos_token=tok.piece(tok.eos_id))
    for dialog in (DIALOG, DIALOG[1:2], DIALOG[1:]):
        text = ref.apply_chat_template(dialog, chat_template=source, tokenize=False, add_generation_prompt=True, **kw)
        assert fmt.render(dialog) == text
        assert fmt.encode_dialog_prompt(dialog) == ref.encode(text, add_special_tokens=False)
    prompt = fmt.encode_dialog_prompt(DIALOG)
    assert reasoning.prompt_opens_think(tok, prompt) is opens_think
    assert reasoning.reasons(fmt) is ("</think>" in source)
    if "DeepSeek" in template or "Qwen3" in template:  # earlier turns' reasoning is dropped by the template
        assert "Add one" not in fmt.render(DIALOG) and "12346" in fmt.render(DIALOG)


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {"enable_thinking": True},
                                    {"unread": [1, {"a": None}]}])
def test_template_kwargs_render_as_transformers(vocab, kwargs):
    """chat_template_kwargs are the template's extra variables, as apply_chat_template(**kwargs) passes them: Qwen3
    with thinking off ends its generation prompt in an empty think block, which leaves the reply outside one; a
    tool dialog keeps the kwargs of the dialog it wraps."""
    from tokenizers import Tokenizer

    source = peers.template("Qwen-Qwen3-0.6B.jinja")
    tok = vocab("qwen2")
    tok.chat_template = source
    fmt = chat_format_for(tok)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.tok.to_str()))
    for dialog in (DIALOG, DIALOG[1:2]):
        text = ref.apply_chat_template(dialog, chat_template=source, tokenize=False, add_generation_prompt=True,
                                       **kwargs)
        carried = with_template_kwargs(dialog, kwargs)
        assert fmt.render(carried) == fmt.render(dialog, template_kwargs=kwargs) == text
        assert list(carried) == list(dialog) and with_template_kwargs(dialog, {}) is dialog
        assert fmt.encode_dialog_prompt(carried) == ref.encode(text, add_special_tokens=False)
        assert text.endswith("<think>\n\n</think>\n\n") is (kwargs.get("enable_thinking") is False)
        assert not reasoning.prompt_opens_think(tok, fmt.encode_dialog_prompt(carried))
        tools = ToolDialog(carried, [], "hermes")
        assert tools.template_kwargs == kwargs and fmt.encode_dialog_prompt(tools) == fmt.encode_dialog_prompt(carried)
        assert with_template_kwargs(tools, {"x": 1}).template_kwargs == {**kwargs, "x": 1} and tools.template_kwargs \
            == kwargs


@pytest.mark.parametrize("kwargs, error, match", [
    ("enable_thinking=False", TypeError, "chat_template_kwargs must be a dict"),
    ({"enable_thinking": "false"}, ValueError, "'enable_thinking' must be true or false, got 'false'"),
    ({"messages": []}, ValueError, "'messages' is set by the chat format itself"),
    ({"add_generation_prompt": False}, ValueError, "'add_generation_prompt' is set by the chat format itself"),
    ({1: True}, ValueError, "keys must be strings"),
    ({"x": {1, 2}}, ValueError, "'x' must be a JSON value"),
    ({"x": {"a": object()}}, ValueError, "'x' must be a JSON value"),
])
def test_bad_template_kwargs_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        check_template_kwargs(kwargs)
    assert check_template_kwargs(None) == {} and check_template_kwargs({"a": [1.5, None]}) == {"a": [1.5, None]}


@pytest.mark.parametrize("text, in_think, expected", [
    ("<think>\nplan\n</think>\n\nanswer", False, ("plan", "answer")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("plan\n</think>\n\nanswer", True, ("plan", "answer")),
    ("plan that never ends", True, ("plan that never ends", "")),
    ("<think>unclosed", False, ("unclosed", "")),
    ("no think here, <think>x</think>", False, (None, "no think here, <think>x</think>")),
    ("answer", False, (None, "answer")),
    ("", False, (None, "")),
    ("</think>answer", True, ("", "answer")),
    ("<think>\nplan</think>answer", True, ("plan", "answer")),
    ("<thi", True, ("<thi", "")),
])
def test_split(text, in_think, expected):
    assert reasoning.split(text, in_think) == expected


@pytest.mark.parametrize("text, in_think", [
    ("<think>\nplan with </thi and < signs\n</think>\n\nanswer </think> kept", False),
    ("  \n<think>x y z</think>", False), ("plan\n\n</think>\n\n\nanswer  ", True), ("plain <think> reply", False),
    ("<thinking>is not a tag</thinking>", False), ("never closed\n\n", True), (" ", False), ("<thi", False),
    (" <think>again</think> x", True), ("<thi", True), ("<thinker", True)])
def test_streamed_deltas_concatenate_to_the_whole_split_at_any_cut_points(text, in_think):
    whole = reasoning.split(text, in_think)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream, thought, content = reasoning.ReasoningStream(in_think), "", ""
        for p in pieces:
            t, c = stream.feed(p)
            thought, content = thought + t, content + c
        t, c = stream.finish()
        assert (thought + t, content + c) == (whole[0] or "", whole[1]), pieces
