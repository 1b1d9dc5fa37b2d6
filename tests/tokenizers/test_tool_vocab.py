"""Tool prompts and calls in Llama 3's real vocabulary (the shared tokenizer.model), where test_tool_format.py's
template tests use SmolLM2's, in which every marker is plain text: Meta's format through llama.tokenizer.Tokenizer,
and the Llama 3.1/3.2 templates through a GGUF of that vocabulary (as a Llama 3 GGUF carries it) against
transformers. <|begin_of_text|>, <|start_header_id|>, <|end_header_id|>, <|eom_id|>, <|eot_id|> and
<|python_tag|> must be their single special ids, and a call we write, generated as those tokens, must parse back.
Hermes' <tool_call> and Mistral's [TOOL_CALLS] are not Llama 3 tokens: here they are checked as the plain text they
are in this vocabulary (Mistral's own, where [TOOL_CALLS] is one token, is test_mistral.py's)."""

import json
import warnings

import peers
import pytest
from conftest import SHARED, need
from test_tool_format import CALL, SEARCH, WEATHER, builtin_turns, dialog, openai_messages

from llama.core.frontend.textstream import TextStream
from llama.sample.tool_grammar import calls_lark, special_ids
from llama.tokenizers.chat_format import Llama3ChatFormat, TemplateChatFormat
from llama.tokenizers.tool_format import ToolDialog, call_text, family_of, parse

LLAMA3 = SHARED / "tokenizers" / "llama3" / "tokenizer.model"
SPECIAL = {"<|begin_of_text|>": 128000, "<|start_header_id|>": 128006, "<|end_header_id|>": 128007,
           "<|eom_id|>": 128008, "<|eot_id|>": 128009, "<|python_tag|>": 128010}


@pytest.fixture(scope="module")
def llama3():
    """Meta's Llama 3 tokenizer as Meta's llama.tokenizer.Tokenizer(path) names it (our Llama3Tokenizer)."""
    from llama.tokenizer import Tokenizer

    tok = Tokenizer(str(need(LLAMA3)))
    assert {name: tok.special_tokens[name] for name in SPECIAL} == SPECIAL
    return tok


def tool_dialog():
    """test_tool_format's dialog plus a built-in search and a code_interpreter call; a tool result spells
    <|eot_id|> as text, which must stay text."""
    return dialog() + builtin_turns("rain (the page ends in <|eot_id|>)")


def contains(ids, part) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def reply_text(tok, prompt, reply) -> str:
    """The text a reply of these tokens comes back as (the server's TextStream; the stop token is not in it)."""
    stream = TextStream(tok, context=prompt)
    return "".join(stream.add(t) for t in reply) + stream.finish()


def assistant_turns(ids, header, ends):
    """(tokens before, body) of each assistant message in a prompt, its closing token left out."""
    out, at = [], 0
    while contains(ids[at:], header):
        start = next(i for i in range(at, len(ids)) if ids[i:i + len(header)] == header) + len(header)
        end = next((i for i in range(start, len(ids)) if ids[i] in ends), None)
        if end is None:  # the generation prompt's header
            break
        out.append((ids[:start], ids[start:end]))
        at = end
    return out


@pytest.mark.parametrize("family", ["llama3_json", "pythonic"])
def test_meta_tool_prompt_has_single_special_ids(llama3, family):
    """Every turn is <|start_header_id|>role<|end_header_id|> ... <|eot_id|> in single ids; built-in calls end in
    <|eom_id|>, code_interpreter's starts with <|python_tag|>; special-token text inside a message stays text."""
    msgs = tool_dialog()
    fmt = Llama3ChatFormat(llama3, tool_style=family)
    ids = fmt.encode_dialog_prompt(ToolDialog(msgs, [WEATHER, SEARCH], family))
    turns = len(msgs) + (family == "llama3_json")  # 3.1 lists its custom tools in a user message of their own
    count = {name: ids.count(i) for name, i in SPECIAL.items()}
    assert ids[0] == SPECIAL["<|begin_of_text|>"] and count["<|begin_of_text|>"] == 1
    assert count["<|start_header_id|>"] == count["<|end_header_id|>"] == turns + 1  # and the reply's header
    assert count["<|eom_id|>"] == 2 and count["<|eot_id|>"] == turns - 2 and count["<|python_tag|>"] == 1
    assert {i for i in ids if i >= 128000} == set(SPECIAL.values())
    spelled = msgs[-4]["content"]  # the tool result's text: its tokens are all there, none of them special
    assert contains(ids, llama3.encode(spelled, bos=False, eos=False))
    assert llama3.decode([i for i in ids if i < 128000]).count("<|") == 1  # nothing else is spelled out


@pytest.mark.parametrize("family", ["llama3_json", "pythonic"])
def test_meta_calls_parse_back_from_their_tokens(llama3, family):
    """Each assistant message of our prompt, generated as those tokens (the model stops on its <|eot_id|> or
    <|eom_id|>), reads back as the calls it holds; so does a 3.1 call after <|python_tag|>, as Meta's document
    shows the model writing one."""
    fmt = Llama3ChatFormat(llama3, tool_style=family)
    msgs = tool_dialog()
    ids = fmt.encode_dialog_prompt(ToolDialog(msgs, [WEATHER, SEARCH], family))
    turns = assistant_turns(ids, fmt.encode_header("assistant"), {SPECIAL["<|eot_id|>"], SPECIAL["<|eom_id|>"]})
    replies = [m for m in msgs if m["role"] == "assistant"]
    assert len(turns) == len(replies) == 4
    for (before, body), m in zip(turns, replies):
        calls = [(c["name"], c["arguments"]) for c in m.get("tool_calls", [])]
        assert parse(family, reply_text(llama3, before, body)) == ((None, calls) if calls else (m["content"], []))
    if family == "llama3_json":
        tagged = [SPECIAL["<|python_tag|>"]] + llama3.encode(call_text(family, CALL), bos=False, eos=False)
        assert parse(family, reply_text(llama3, ids, tagged)) == (None, [(CALL["name"], CALL["arguments"])])


@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory):
    """The shared Llama 3 vocabulary as transformers converts it (TikTokenConverter, its specials added), and ours
    from a GGUF of it written as convert_hf_to_gguf.py writes a Llama 3 one (pre 'llama-bpe')."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from vocab_gguf import write_vocab_gguf

    from llama.formats.gguf_file import open_reader
    from llama.tokenizers import huggingface
    from llama.tokenizers.llama3 import Llama3Tokenizer

    meta = Llama3Tokenizer(str(need(LLAMA3)))
    hf = TikTokenConverter(vocab_file=str(LLAMA3), pattern=meta.pat_str).converted()
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False)
                           for s in sorted(meta.special_tokens, key=meta.special_tokens.get)])
    path = write_vocab_gguf(tmp_path_factory.mktemp("llama3") / "llama3.gguf", hf, "llama-bpe", "<|begin_of_text|>",
                            "<|eot_id|>")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = huggingface.from_gguf(open_reader(path), path)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=hf, bos_token="<|begin_of_text|>",
                                               eos_token="<|eot_id|>")
    return ours, ref


@pytest.mark.parametrize("name", ["meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja"])
def test_llama3_templates_tool_dialog_in_llama3_vocab(llama3_gguf, name):
    """The templates' tool dialogs token for token as transformers tokenizes them in Llama 3's vocabulary, their
    headers and ends single ids; the call the template wrote, generated as those tokens, parses back."""
    ours_tok, hf_tok = llama3_gguf
    template = peers.template(name)
    fmt = TemplateChatFormat(ours_tok, template)
    msgs = dialog(1)
    ids = fmt.encode_dialog_prompt(ToolDialog(msgs, [WEATHER], family_of(fmt)))
    ref = hf_tok.apply_chat_template(openai_messages(msgs), tools=[WEATHER], chat_template=template,
                                     add_generation_prompt=True, tokenize=True)
    assert ids == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert {i for i in ids if i >= 128000} == {SPECIAL[n] for n in ("<|begin_of_text|>", "<|start_header_id|>",
                                                                     "<|end_header_id|>", "<|eot_id|>")}
    assert ids.count(SPECIAL["<|start_header_id|>"]) == ids.count(SPECIAL["<|eot_id|>"]) + 1 == len(msgs) + 1
    header = [SPECIAL["<|start_header_id|>"]] + ours_tok.encode("assistant", bos=False, eos=False) + \
        [SPECIAL["<|end_header_id|>"]] + ours_tok.encode("\n\n", bos=False, eos=False)
    (before, body), _ = assistant_turns(ids, header, {SPECIAL["<|eot_id|>"]})
    call = msgs[2]["tool_calls"][0]
    assert parse(family_of(fmt), reply_text(ours_tok, before, body)) == (None, [(call["name"], call["arguments"])])


@pytest.mark.parametrize("family, marker", [("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]")])
def test_other_families_markers_are_plain_text_in_llama3(llama3, family, marker):
    """Llama 3's vocabulary has no token for Hermes' or Mistral's call marker: it is several ordinary tokens, the
    call grammar spells it as text (no special id to force), and a call written with it parses back from them."""
    plain = llama3.encode(marker, bos=False, eos=False)
    assert len(plain) > 1 and max(plain) < 128000 and marker not in special_ids(llama3)
    lark = calls_lark(family, [WEATHER["function"]], False, special_ids(llama3))
    assert json.dumps(marker) in lark and "<[" not in lark
    body = {"name": CALL["name"], "arguments": CALL["arguments"]}
    text = call_text(family, CALL) if family == "hermes" else f"{marker}[{json.dumps(body)}]"
    reply = llama3.encode(text, bos=False, eos=False)
    assert reply_text(llama3, [], reply) == text
    assert parse(family, text) == (None, [(CALL["name"], CALL["arguments"])])
