"""Code written against Meta's repositories runs here: every public name of llama/generation.py, llama/model.py
and llama/tokenizer.py in Meta's llama (Llama 2) and llama3 imports from the same path and, called with Meta's
signature, computes what Meta's computes. Compared with llama-models (Meta's reference code, a test dependency)
where it has the function, else with Meta's Llama 2 constants and template rule."""

import ast
import copy
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import LLAMA2_TOKENIZER, SHARED, need

from llama.distributed.parallel import init_distributed

LLAMA3_TOKENIZER = SHARED / "tokenizers" / "llama3" / "tokenizer.model"

META_NAMES = {
    "llama.generation": ["Llama", "CompletionPrediction", "ChatPrediction", "sample_top_p", "Role", "Message",
                         "Dialog", "B_INST", "E_INST", "B_SYS", "E_SYS", "SPECIAL_TAGS", "UNSAFE_ERROR", "Tokenizer",
                         "ChatFormat"],
    "llama.model": ["ModelArgs", "RMSNorm", "precompute_freqs_cis", "reshape_for_broadcast", "apply_rotary_emb",
                    "repeat_kv", "Attention", "FeedForward", "TransformerBlock", "Transformer"],
    "llama.tokenizer": ["Tokenizer", "ChatFormat", "Role", "Message", "Dialog"],
}


@pytest.fixture(scope="module")
def ref():
    """llama-models' reference model module."""
    pytest.importorskip("llama_models", reason="llama-models (Meta's reference code) is a test dependency")
    return importlib.import_module("llama_models.llama3.model")


@pytest.mark.parametrize("module", sorted(META_NAMES))
def test_every_meta_name_imports_from_metas_path(module):
    mod = importlib.import_module(module)
    missing = [name for name in META_NAMES[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lacks Meta's {missing}"


def test_llama2_constants_are_metas():
    from llama.generation import B_INST, B_SYS, E_INST, E_SYS, SPECIAL_TAGS, UNSAFE_ERROR

    assert (B_INST, E_INST) == ("[INST]", "[/INST]")
    assert (B_SYS, E_SYS) == ("<<SYS>>\n", "\n<</SYS>>\n\n")
    assert SPECIAL_TAGS == ["[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"]
    assert UNSAFE_ERROR == "Error: special tags are not allowed as part of the prompt."


# ------------------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("theta,use_scaled", [(10000.0, False), (500000.0, False), (500000.0, True)])
def test_precompute_freqs_cis_is_metas(ref, theta, use_scaled):
    from llama.model import precompute_freqs_cis

    ours = precompute_freqs_cis(128, 300, theta, use_scaled=use_scaled)
    assert ours.dtype == torch.complex64 and ours.shape == (300, 64)
    assert torch.equal(ours, ref.precompute_freqs_cis(128, 300, theta, use_scaled))
    if not use_scaled:  # Meta's llama and llama3 have no use_scaled: positional (dim, end, theta)
        assert torch.equal(precompute_freqs_cis(128, 300, theta), ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_emb_is_metas_and_the_models_rotation(ref, dtype):
    from llama.model import apply_rotary, apply_rotary_emb, precompute_freqs_cis, rope_tables

    torch.manual_seed(0)
    xq, xk = torch.randn(2, 7, 4, 16).to(dtype), torch.randn(2, 7, 2, 16).to(dtype)
    freqs_cis = precompute_freqs_cis(16, 7, 500000.0)
    q, k = apply_rotary_emb(xq, xk, freqs_cis)
    q_ref, k_ref = ref.apply_rotary_emb(xq, xk, freqs_cis)
    assert q.dtype == dtype and torch.equal(q, q_ref) and torch.equal(k, k_ref)
    cos, sin = rope_tables(16, 7, 500000.0)  # the model's own real-arithmetic rotation agrees
    torch.testing.assert_close(apply_rotary(xq, cos, sin), q)


def test_reshape_for_broadcast_and_repeat_kv_are_metas(ref):
    from llama.model import repeat_kv, reshape_for_broadcast

    x = torch.randn(2, 5, 3, 8, dtype=torch.complex64)
    freqs = torch.randn(5, 8, dtype=torch.complex64)
    assert torch.equal(reshape_for_broadcast(freqs, x), ref.reshape_for_broadcast(freqs, x))
    with pytest.raises(ValueError, match=r"freqs_cis of shape \(4, 8\) must be"):
        reshape_for_broadcast(freqs[:4], x)
    kv = torch.randn(2, 5, 3, 8)
    for n_rep in (1, 4):
        assert torch.equal(repeat_kv(kv, n_rep), ref.repeat_kv(kv, n_rep))
    assert repeat_kv(kv, 1) is kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_metas(ref, dtype):
    from llama.model import RMSNorm

    torch.manual_seed(0)
    ours, theirs = RMSNorm(64, eps=1e-5), ref.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(64) + 0.5)
        theirs.weight.copy_(ours.weight)
        x = torch.randn(3, 7, 64).to(dtype)
        torch.testing.assert_close(ours.to(dtype)(x), theirs.to(dtype)(x))


def test_feed_forward_takes_metas_signature(ref):
    from llama.model import FeedForward

    init_distributed(1, torch.device("cpu"))
    torch.manual_seed(0)
    kwargs = dict(dim=64, hidden_dim=4 * 64, multiple_of=32, ffn_dim_multiplier=1.3)  # as Meta's block calls it
    ours, theirs = FeedForward(**kwargs), ref.FeedForward(**kwargs)
    assert ours.w1.weight.shape == theirs.w1.weight.shape == (224, 64)  # int(2 * 256 / 3) * 1.3 -> 221, up to 224
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(ours, name).weight.copy_(torch.randn_like(getattr(theirs, name).weight) * 0.1)
            getattr(theirs, name).weight.copy_(getattr(ours, name).weight)
        x = torch.randn(2, 3, 64)
        torch.testing.assert_close(ours(x), theirs(x))


# ------------------------------------------------------------------------------------------------- sampling
def metas_function(module: str, name: str):
    """A top-level function of a llama-models module, defined from its source alone: llama_models.llama3.generation
    imports torchvision (for images), which this suite does not need."""
    origin = importlib.util.find_spec(module).origin
    node = next(n for n in ast.parse(Path(origin).read_text()).body if getattr(n, "name", None) == name)
    namespace = {"torch": torch}
    exec(compile(ast.Module([node], type_ignores=[]), origin, "exec"), namespace)
    return namespace[name]


def test_sample_top_p_is_metas():
    pytest.importorskip("llama_models", reason="llama-models (Meta's reference code) is a test dependency")
    from llama.generation import sample_top_p

    metas = metas_function("llama_models.llama3.generation", "sample_top_p")

    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 3, dim=-1)
    for seed in range(5):
        torch.manual_seed(seed)
        ours = sample_top_p(probs.clone(), 0.9)
        torch.manual_seed(seed)
        assert torch.equal(ours, metas(probs.clone(), 0.9)) and ours.shape == (4, 1)
    # The nucleus keeps the token that crosses p (0.5 + 0.3 > 0.6) and drops the next, renormalised: 5/8, 3/8.
    probs = torch.tensor([[0.2, 0.5, 0.3]]).expand(400, 3).contiguous()
    torch.manual_seed(0)
    ours = sample_top_p(probs.clone(), 0.6)
    torch.manual_seed(0)
    assert torch.equal(ours, metas(probs.clone(), 0.6))
    assert set(ours.flatten().tolist()) == {1, 2}


# ------------------------------------------------------------------------------------------------- Llama 3 tokenizer
@pytest.fixture(scope="module")
def llama3():
    """(ours, Meta's) tokenizer and chat format for the Llama 3 tokenizer file, ours from Meta's path."""
    pytest.importorskip("llama_models", reason="llama-models (Meta's reference code) is a test dependency")
    from llama_models.llama3.chat_format import ChatFormat as MetaChatFormat
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    from llama.tokenizer import ChatFormat, Tokenizer

    ours, theirs = Tokenizer(str(need(LLAMA3_TOKENIZER))), MetaTokenizer(LLAMA3_TOKENIZER)
    return ours, theirs, ChatFormat(ours), MetaChatFormat(theirs)


TEXTS = ["This is a test sentence.", "  spaces\n\n\ttabs ", "emoji 🦙 and 中文", "a literal <|eot_id|> here", ""]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_llama3_tokenizer_is_metas(llama3, text):
    ours, theirs = llama3[:2]
    for kw in ({}, {"allowed_special": "all"}, {"allowed_special": {"<|eot_id|>"}}):
        ids = ours.encode(text, bos=True, eos=False, **kw)
        assert ids == theirs.encode(text, bos=True, eos=False, **kw)
        assert ours.decode(ids) == theirs.decode(ids)
    if "<|eot_id|>" in text:
        assert ours.special_tokens["<|eot_id|>"] in ours.encode(text, bos=False, eos=False, allowed_special="all")
        with pytest.raises(ValueError, match="disallowed special token"):
            ours.encode(text, bos=False, eos=False, disallowed_special="all")


def test_llama3_tokenizer_has_both_interfaces(llama3):
    ours, theirs = llama3[:2]
    assert ours.special_tokens == theirs.special_tokens
    assert (ours.n_words, ours.bos_id, ours.eos_id, ours.pad_id) == (128256, 128000, 128001, -1)  # llama3's pad_id
    assert set(ours.stop_tokens) == set(theirs.stop_tokens)  # Meta's is a list/set; ours maps id -> reason
    assert ours.stop_tokens[ours.special_tokens["<|eot_id|>"]] == "eot"
    assert ours.piece(2028) == "This" and ours.num_reserved_special_tokens == 256 and ours.pat_str == theirs.pat_str


def test_llama3_chat_format_is_metas(llama3):
    from llama_models.datatypes import RawMessage

    ours_tok, _, ours, theirs = llama3
    dialog = [{"role": "system", "content": "Always answer with Haiku"}, {"role": "user", "content": "Hi there"},
              {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "A joke."}]
    expected = theirs.encode_dialog_prompt([RawMessage(role=m["role"], content=m["content"]) for m in dialog]).tokens
    assert ours.encode_dialog_prompt(dialog) == expected
    assert ours.encode_header({"role": "user", "content": ""}) == theirs._encode_header("user")  # llama3's form
    assert ours.encode_header("user") == theirs._encode_header("user")
    assert ours.encode_message(dialog[1]) == theirs.encode_message(RawMessage(**dialog[1]), None)[0]
    import llama

    assert llama.ChatFormat is llama.tokenizer.ChatFormat and type(llama.ChatFormat(ours_tok)) is type(ours)


# ------------------------------------------------------------------------------------------------- Llama 2 tokenizer
def test_llama2_tokenizer_and_template_are_metas():
    from llama.tokenizer import ChatFormat, Tokenizer

    tok = Tokenizer(str(need(LLAMA2_TOKENIZER)))
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (32000, 1, 2, -1)
    assert tok.sp_model.vocab_size() == 32000
    ids = tok.encode("Hello world", True, True)  # Meta's llama takes bos/eos positionally
    assert ids == [1] + tok.sp_model.encode("Hello world") + [2] and tok.decode(ids) == "Hello world"

    # Meta's llama chat_completion builds the prompt so (llama/generation.py), with its B_INST/B_SYS constants.
    from llama.generation import B_INST, B_SYS, E_INST, E_SYS

    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?\n"}]
    folded = [{"role": "user", "content": B_SYS + dialog[0]["content"] + E_SYS + dialog[1]["content"]}] + dialog[2:]
    expected = sum([tok.encode(f"{B_INST} {p['content'].strip()} {E_INST} {a['content'].strip()} ", bos=True, eos=True)
                    for p, a in zip(folded[::2], folded[1::2])], [])
    expected += tok.encode(f"{B_INST} {folded[-1]['content'].strip()} {E_INST}", bos=True, eos=False)
    assert ChatFormat(tok).encode_dialog_prompt(dialog) == expected
    assert copy.copy(ChatFormat(tok)).encode_dialog_prompt(dialog) == expected  # __new__ still lets copy make one


def test_meta_llama_constructor_sizes_the_cache_from_params(stories_dir):
    """Meta's Llama(model, tokenizer): the KV cache takes model.params' max_batch_size and max_seq_len."""
    from llama.generation import Llama

    built = Llama.build(str(stories_dir), str(stories_dir / "tokenizer.model"), max_seq_len=48, max_batch_size=2)
    prompts = ["Once upon a time", "The cat"]
    expected = built.text_completion(prompts, temperature=0.0, max_gen_len=12)
    meta_style = Llama(built.model, built.tokenizer)
    assert (meta_style.max_batch_size, meta_style.max_seq_len) == (2, 48)
    assert meta_style.text_completion(prompts, temperature=0.0, max_gen_len=12) == expected
