"""Llama 3.x: Meta's tiktoken tokenizer and header chat format against Meta's published test vectors, and a
random Llama-3.1-shaped checkpoint against Hugging Face transformers' LlamaForCausalLM with llama3 rope scaling
(logits, greedy ids alone, batched and through the engine), tied embeddings, vocabulary-split shards, and
generation that stops at <|eot_id|> / <|eom_id|>."""

import json
from pathlib import Path

import pytest
import torch
from conftest import SHARED, need, rank_env
from helpers import meta_to_hf

from llama import Llama
from llama.hub.demo import random_state_dict
from llama.formats.meta_checkpoint import save_checkpoint
from llama.model import ModelArgs
from llama.tokenizers.chat_format import Llama3ChatFormat, chat_format_for
from llama.tokenizers.llama3 import MAX_RUN, Llama3Tokenizer, split_runs
from llama.tokenizers.sentencepiece import load_tokenizer

LLAMA3_TOKENIZER = SHARED / "tokenizers" / "llama3" / "tokenizer.model"
PARAMS = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "ffn_dim_multiplier": 1.3,
          "norm_eps": 1e-5, "rope_theta": 500000.0, "use_scaled_rope": True, "vocab_size": 128256}
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(need(LLAMA3_TOKENIZER))


# ------------------------------------------------------------------------------------------------- tokenizer
def test_meta_published_vectors(tok):
    """llama-models' tests/api/test_tokenizer.py."""
    assert isinstance(tok, Llama3Tokenizer) and tok.n_words == 128256
    assert tok.special_tokens["<|begin_of_text|>"] == 128000
    assert [tok.special_tokens[t] for t in ("<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                            "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")] == [128001, 128006, 128007,
                                                                                               128008, 128009, 128010]
    ids = [128000, 2028, 374, 264, 1296, 11914, 13, 128001]
    assert tok.encode("This is a test sentence.", bos=True, eos=True) == ids
    assert tok.decode(ids) == "<|begin_of_text|>This is a test sentence.<|end_of_text|>"


@pytest.mark.parametrize("text", [
    "Hello, world!", "  leading and   inner   spaces\n\n\ttabs", "digits 1234567 and 3.14159", "emoji 🦙🔥👍🏽",
    "中文字符和日本語のテキスト", "def f(x):\n    return x ** 2  # code\n", "Ünïcödé çåsé", "\n\n\n", "",
])
def test_round_trip(tok, text):
    ids = tok.encode(text, bos=False, eos=False)
    assert tok.decode(ids) == text
    assert all(i < 128000 for i in ids)


@pytest.fixture(scope="module")
def meta():
    """Meta's own Llama 3 tokenizer and chat format (llama-models), the reference these are checked against."""
    pytest.importorskip("llama_models", reason="llama-models (Meta's reference code) is a test dependency")
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    tokenizer = Tokenizer(need(LLAMA3_TOKENIZER))
    return tokenizer, ChatFormat(tokenizer)


VARIED = ["Hello, world!", "  leading and   inner   spaces\n\n\ttabs  ", "digits 1234567 and 3.14159e-10",
          "emoji 🦙🔥👍🏽 and flags 🇫🇷", "中文字符和日本語のテキスト、한국어", "def f(x):\n    return x ** 2  # code\n",
          "a literal <|eot_id|> and <|begin_of_text|> in user text", "x" * 30000, " " * 30001 + "end",
          "word " * 9000, "Ünïcödé çåsé\r\nwindows lines"]


@pytest.mark.parametrize("text", VARIED, ids=range(len(VARIED)))
def test_encode_and_decode_equal_metas(tok, meta, text):
    ids = tok.encode(text, bos=True, eos=True)
    assert ids == meta[0].encode(text, bos=True, eos=True)
    assert tok.decode(ids) == meta[0].decode(ids)


def test_chat_prompts_equal_metas(tok, meta):
    from llama_models.datatypes import BuiltinTool, RawMessage, StopReason, ToolCall

    fmt = chat_format_for(tok)
    dialogs = [
        [{"role": "system", "content": "Always answer with Haiku"}, {"role": "user", "content": "I am going to Paris"}],
        [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Tell me a joke\n"}],
        [{"role": "user", "content": "What is 2**10?"}, {"role": "assistant", "content": "<|python_tag|>print(2**10)"},
         {"role": "tool", "content": "1024"}],
    ]
    call = ToolCall(call_id="1", tool_name=BuiltinTool.code_interpreter, arguments={"code": "print(2**10)"})
    for dialog in dialogs:
        messages = []
        for m in dialog:
            if m["content"].startswith("<|python_tag|>"):
                messages.append(RawMessage(role="assistant", content="", tool_calls=[call],
                                           stop_reason=StopReason.end_of_message))
            else:
                messages.append(RawMessage(role=m["role"], content=m["content"]))
        assert fmt.encode_dialog_prompt(dialog) == meta[1].encode_dialog_prompt(messages).tokens


def test_special_token_text_in_content_is_plain_text(tok):
    ids = tok.encode("say <|eot_id|> and <|begin_of_text|>", bos=False, eos=False)
    assert not set(ids) & set(tok.special_tokens.values())
    assert tok.decode(ids) == "say <|eot_id|> and <|begin_of_text|>"


def test_long_runs_are_split_as_meta_does(tok):
    assert [len(p) for p in split_runs("a" * 30000)] == [MAX_RUN, 30000 - MAX_RUN]
    assert [len(p) for p in split_runs("ab" * 10 + " " * 30000 + "x")] == [20 + MAX_RUN, 30000 - MAX_RUN + 1]
    text = "word " + "a" * 30000 + " tail"
    ids = tok.encode(text, bos=True, eos=False)
    assert tok.decode(ids[1:]) == text
    # A cut run encodes as its pieces do: the cut is the only difference from one unbroken call.
    pieces = list(split_runs(text))
    assert ids[1:] == [i for p in pieces for i in tok.model.encode(p, disallowed_special=())]


def test_streamed_text_never_splits_a_character(tok):
    """Byte-level BPE spreads one emoji over several tokens (🦙: 3, none a character by itself): streamed deltas
    hold only whole characters and add up to the text, stop strings included."""
    from llama.core.frontend.textstream import TextStream

    text = " Llamas 🦙 say 你好, 👍🏽 and stop here 🇫🇷 unseen"
    ids = tok.encode(text, bos=False, eos=False)
    assert len(tok.encode("🦙", bos=False, eos=False)) == 3
    stream = TextStream(tok, context=tok.encode("Hi:", bos=True, eos=False))
    deltas = [stream.add(i) for i in ids] + [stream.finish()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    stream = TextStream(tok, stop=["stop here"])
    out = "".join(stream.add(i) for i in ids) + stream.finish()
    assert out == " Llamas 🦙 say 你好, 👍🏽 and " and stream.stopped


def test_a_llama3_tokenizer_json_stops_on_every_stop_token(tmp_path):
    """A Hugging Face Llama 3 directory's tokenizer.json (loaded by tokenizer_hf) names one eos_token, <|eot_id|> for
    Instruct models: the family's other stops (<|end_of_text|>, <|eom_id|>) must end a generation too."""
    import json

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>", "<|python_tag|>"]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                               "eos_token": "<|eot_id|>", "add_bos_token": True}))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    ids = {t: hf.token_to_id(t) for t in names}
    assert tok.eos_id == ids["<|eot_id|>"]
    assert tok.stop_tokens == {ids["<|end_of_text|>"]: "eos", ids["<|eot_id|>"]: "eot", ids["<|eom_id|>"]: "eom"}


def test_a_file_of_neither_kind_is_refused(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_text("not a tokenizer\n")
    with pytest.raises(ValueError, match="neither a sentencepiece model .* nor a tiktoken BPE rank file"):
        load_tokenizer(bad)


# ------------------------------------------------------------------------------------------------- chat format
def header(tok, role):
    return [128006] + tok.encode(role, bos=False, eos=False) + [128007, 271]


def test_chat_format_meta_vectors_and_multi_turn(tok):
    fmt = chat_format_for(tok)
    assert isinstance(fmt, Llama3ChatFormat) and not fmt.strip_reply_space
    # llama-models' test_encode_dialog: system + user, then the assistant header.
    assert fmt.encode_dialog_prompt([{"role": "system", "content": "This is a test sentence."},
                                     {"role": "user", "content": "This is a response."}]) == [
        128000, 128006, 9125, 128007, 271, 2028, 374, 264, 1296, 11914, 13, 128009,
        128006, 882, 128007, 271, 2028, 374, 264, 2077, 13, 128009, 128006, 78191, 128007, 271]
    enc = lambda s: tok.encode(s, bos=False, eos=False)  # noqa: E731
    turns = [{"role": "user", "content": " Hi there "}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Weather?"}]
    expected = [128000]
    for m in turns:  # content kept as given (llama-models), no stripping
        expected += header(tok, m["role"]) + enc(m["content"]) + [128009]
    assert fmt.encode_dialog_prompt(turns) == expected + header(tok, "assistant")


def test_tool_call_and_tool_output(tok):
    fmt = chat_format_for(tok)
    enc = lambda s: tok.encode(s, bos=False, eos=False)  # noqa: E731
    dialog = [{"role": "user", "content": "What is 2**10?"},
              {"role": "assistant", "content": "<|python_tag|>print(2**10)"},
              {"role": "tool", "content": "1024"}]
    assert fmt.encode_dialog_prompt(dialog) == (
        [128000] + header(tok, "user") + enc("What is 2**10?") + [128009]
        + header(tok, "assistant") + [128010] + enc("print(2**10)") + [128008]
        + header(tok, "ipython") + enc("1024") + [128009] + header(tok, "assistant"))
    with pytest.raises(ValueError, match="last message must be from the user or a tool"):
        fmt.encode_dialog_prompt(dialog[:2])
    with pytest.raises(ValueError, match="unknown role"):
        fmt.encode_dialog_prompt([{"role": "robot", "content": "x"}])


# ------------------------------------------------------------------------------------------------- model
def hf_model(state, args, tied=False, scaled=True, factor=8.0):
    transformers = pytest.importorskip("transformers", reason="transformers is the independent reference here")
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        rms_norm_eps=args.norm_eps, max_position_embeddings=16384, tie_word_embeddings=tied,
        rope_parameters={"rope_theta": args.rope_theta,
                         **({**SCALING, "factor": factor} if scaled else {"rope_type": "default"})})
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(meta_to_hf(state, args.n_layers, args.n_heads, args.n_kv_heads, tied), strict=not tied)
    return model


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A random Llama-3.1-shaped checkpoint with the real tokenizer, its full weights, and a generator."""
    need(LLAMA3_TOKENIZER)
    d = tmp_path_factory.mktemp("llama31")
    args = ModelArgs.from_params(PARAMS)
    state = random_state_dict(args, seed=3)
    save_checkpoint(state, PARAMS, d, extra_files={"tokenizer.model": LLAMA3_TOKENIZER})
    gen = Llama.build(str(d), str(d / "tokenizer.model"), max_seq_len=1280, max_batch_size=3)
    return d, args, state, gen


def long_prompt(gen, n=1100):
    text = " ".join(f"The number {i} follows {i - 1}." for i in range(1, 400))
    return gen.tokenizer.encode(text, bos=True, eos=False)[:n]


def test_logits_and_greedy_ids_equal_transformers_with_llama3_rope_scaling(llama3):
    d, args, state, gen = llama3
    ref = hf_model(state, args)
    prompt = long_prompt(gen)
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
        got = gen.model(torch.tensor([prompt], device=gen.device), 0)[0].cpu()
    assert len(prompt) == 1100
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # every position, past 1000 included
    with torch.no_grad():
        hf_ids = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    gen.tokenizer.stop_tokens, stops = {}, gen.tokenizer.stop_tokens  # the reference does not stop either
    try:
        alone, _ = gen.generate([prompt], max_gen_len=12, temperature=0)
        short = gen.tokenizer.encode("Once upon a time", bos=True, eos=False)
        batched, _ = gen.generate([short, prompt, short[:3]], max_gen_len=12, temperature=0)
        with gen.engine(prefill_chunk=300) as engine:  # the prompt prefilled over 4 steps
            request = engine.submit(prompt, max_gen_len=12, temperature=0)
            request.result(timeout=120)
    finally:
        gen.tokenizer.stop_tokens = stops
    assert alone[0] == hf_ids and batched[1] == hf_ids and request.generated == hf_ids

    unscaled = hf_model(state, args, scaled=False)  # the scaling is really applied: without it, other ids
    with torch.no_grad():
        assert (unscaled(torch.tensor([prompt])).logits[0, -1] - want[-1]).abs().max() > 1e-2
        other = unscaled.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
    assert other.tolist() != hf_ids


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_rope_frequencies_equal_transformers_llama3_init(factor):
    """The scaled frequencies themselves, against transformers' own llama3 rope initialisation (3.1: 8, 3.2: 32)."""
    transformers = pytest.importorskip("transformers", reason="transformers is the independent reference here")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llama.model import rope_tables

    head_dim, theta = 128, 500000.0
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=131072,
                                      rope_parameters={"rope_theta": theta, **SCALING, "factor": factor})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    cos, sin = rope_tables(head_dim, 2, theta, dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                                                   original_context=8192))
    freqs = torch.atan2(sin[1], cos[1])  # position 1's angles are the frequencies
    torch.testing.assert_close(freqs, inv_freq.float(), rtol=1e-6, atol=0)
    cos, sin = rope_tables(head_dim, 2, theta)
    plain = torch.atan2(sin[1], cos[1])
    assert torch.equal(freqs[:8], plain[:8])  # short wavelengths stay
    torch.testing.assert_close(freqs[-8:], plain[-8:] / factor, rtol=1e-6, atol=0)  # long ones are divided


@pytest.mark.parametrize("change,field", [
    ({"rope_theta": "500000"}, "rope_theta"), ({"rope_theta": 0}, "rope_theta"),
    ({"use_scaled_rope": "yes"}, "use_scaled_rope"), ({"rope_scaling_factor": 0.5}, "rope_scaling_factor"),
    ({"rope_low_freq_factor": 4.0}, "rope_low_freq_factor"), ({"rope_original_context": 0}, "rope_original_context"),
])
def test_bad_rope_settings_are_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        ModelArgs.from_params({**PARAMS, **change})
    ModelArgs.from_params({**PARAMS, "use_scaled_rope": False, "rope_scaling_factor": 0.5})  # unused: not checked


def test_unknown_params_json_keys_warn_instead_of_failing():
    with pytest.warns(UserWarning, match="future_key"):
        args = ModelArgs.from_params({**PARAMS, "future_key": 1})
    assert args.use_scaled_rope and args.rope_theta == 500000.0


def test_without_use_scaled_rope_our_greedy_ids_differ(llama3, tmp_path):
    """The same weights with use_scaled_rope false: other ids past the original context's long wavelengths."""
    import json

    d, args, state, gen = llama3
    (tmp_path / "consolidated.00.pth").symlink_to(d / "consolidated.00.pth")
    (tmp_path / "params.json").write_text(json.dumps({**PARAMS, "use_scaled_rope": False}))
    plain = Llama.build(str(tmp_path), str(d / "tokenizer.model"), max_seq_len=1200, max_batch_size=1)
    assert not plain.model.params.use_scaled_rope
    prompt = long_prompt(gen)
    plain.tokenizer.stop_tokens, gen.tokenizer.stop_tokens, stops = {}, {}, gen.tokenizer.stop_tokens
    try:
        scaled_ids, _ = gen.generate([prompt], max_gen_len=8, temperature=0)
        plain_ids, _ = plain.generate([prompt], max_gen_len=8, temperature=0)
    finally:
        gen.tokenizer.stop_tokens = stops
    assert plain_ids != scaled_ids


def test_two_vocabulary_split_shards_load_at_world_size_1(llama3, tmp_path):
    """Meta's Llama 3 shards split tok_embeddings by vocabulary (dim 0), unlike Llama 2's (dim 1)."""
    d, args, state, gen = llama3
    vocab_split(state, tmp_path, d / "params.json")
    two = Llama.build(str(tmp_path), str(d / "tokenizer.model"), max_seq_len=64, max_batch_size=1)
    prompt = long_prompt(gen, 40)
    torch.testing.assert_close(two.model(torch.tensor([prompt], device=two.device), 0).cpu(),
                               gen.model(torch.tensor([prompt], device=gen.device), 0).cpu(),
                               rtol=0, atol=1e-5)


def test_tied_embeddings_share_the_table(tmp_path):
    """A 3.2-style checkpoint without output.weight: the output projection is the embedding, with no copy."""
    need(LLAMA3_TOKENIZER)
    params = {**PARAMS, "rope_theta": 500000.0}
    args = ModelArgs.from_params(params)
    state = random_state_dict(args, seed=4)
    del state["output.weight"]
    save_checkpoint(state, params, tmp_path, extra_files={"tokenizer.model": LLAMA3_TOKENIZER})
    gen = Llama.build(str(tmp_path), str(tmp_path / "tokenizer.model"), max_seq_len=64, max_batch_size=1,
                      rope_scaling_factor=32.0)
    m = gen.model
    assert m.output.weight.data_ptr() == m.tok_embeddings.weight.data_ptr()
    assert m.params.rope_scaling_factor == 32.0 and m.params.use_scaled_rope
    ref = hf_model(state, args, tied=True, factor=32.0)
    prompt = long_prompt(gen, 48)
    with torch.no_grad():
        torch.testing.assert_close(m(torch.tensor([prompt], device=gen.device), 0)[0].cpu(),
                                   ref(torch.tensor([prompt])).logits[0],
                                   rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="rope_scaling_factor must be"):
        Llama.build(str(tmp_path), str(tmp_path / "tokenizer.model"), max_seq_len=64, max_batch_size=1,
                    rope_scaling_factor=float("nan"))


RSS_CHILD = """
import sys, torch
from llama import Llama

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = hwm()
m = Llama.build(sys.argv[1], sys.argv[2], max_seq_len=32, max_batch_size=1, compile=False).model
with torch.no_grad():
    float(m.tok_embeddings.weight.max()) + float(m.output.weight.max())  # page in every byte of both tables
print(hwm() - before, m.output.weight.data_ptr() == m.tok_embeddings.weight.data_ptr())
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for peak RSS")
def test_tied_embeddings_add_no_copy_to_peak_rss(tmp_path):
    """Peak RSS of Llama.build (fp32, 1 layer, vocab 128256, dim 512: a 251 MiB table) from a tied checkpoint of 1
    shard and of 2 vocabulary-split shards: one table, plus at most one shard's half while merging. A second copy
    of the table (an untied output) would add a whole table to either."""
    import subprocess
    import sys


    need(LLAMA3_TOKENIZER)
    params = {**PARAMS, "dim": 512, "n_layers": 1, "n_heads": 8, "n_kv_heads": 8}
    state = random_state_dict(ModelArgs.from_params(params), seed=5)
    del state["output.weight"]
    table = state["tok_embeddings.weight"].numel() * 4
    save_checkpoint(state, params, tmp_path / "one")
    (tmp_path / "two").mkdir()
    (tmp_path / "params.json").write_text(json.dumps(params))
    vocab_split(state, tmp_path / "two", tmp_path / "params.json")
    del state
    (tmp_path / "child.py").write_text(RSS_CHILD)
    for name, bound in (("one", 1.5), ("two", 2.25)):
        out = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path / name), str(LLAMA3_TOKENIZER)],
                             capture_output=True, text=True, timeout=300,
                             env=rank_env(1, LLAMA_DEVICE="cpu", LLAMA_TEST_DEVICE="cpu"))  # host RSS: a CPU matter
        assert out.returncode == 0, out.stderr[-3000:]
        grown, shared = out.stdout.split()[-2:]  # after the loader's "Loaded in" line
        assert shared == "True"
        assert int(grown) < bound * table, f"{name}: peak RSS grew {int(grown) / 2**20:.0f} MiB for a " \
                                           f"{table / 2**20:.0f} MiB table"


# ------------------------------------------------------------------------------------------------- stopping
def forcing(seq):
    def force(ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[seq[min(len(ids), len(seq) - 1)]] = 0.0
        return out
    return force


def test_generation_stops_at_eot_and_eom(llama3):
    d, args, state, gen = llama3
    tok = gen.tokenizer
    words = tok.encode(" Paris is the capital.", bos=False, eos=False)
    dialog = [{"role": "user", "content": "What is the capital of France?"}]
    reply = gen.chat_completion([dialog], logits_processors=[forcing(words + [128009])], max_gen_len=30)[0]
    assert reply["generation"] == {"role": "assistant", "content": " Paris is the capital."}
    code = [128010] + tok.encode("print(2**10)", bos=False, eos=False) + [128008]
    with gen.engine() as engine:
        eot = engine.submit(dialog, logits_processors=[forcing(words + [128009])], max_gen_len=30)
        eom = engine.submit(dialog, logits_processors=[forcing(code)], max_gen_len=30)
        assert eot.result(timeout=60)["generation"]["content"] == " Paris is the capital."
        call = eom.result(timeout=60)["generation"]["content"]
    assert (eot.finish_reason, eom.finish_reason) == ("eot", "eom")
    assert call == "<|python_tag|>print(2**10)"  # the tool call, intact, to run and answer with an ipython turn
    follow = dialog + [{"role": "assistant", "content": call}, {"role": "tool", "content": "1024"}]
    assert 128010 in gen.formatter.encode_dialog_prompt(follow)
    end = gen.text_completion(["Hello"], logits_processors=[forcing(words + [128001])], max_gen_len=30)[0]
    assert end["generation"] == tok.decode(words)


# ------------------------------------------------------------------------------------------------- conversion, parallel
@pytest.mark.parametrize("tied", [False, True])
def test_hf_llama3_checkpoint_converts(llama3, tmp_path, tied, capsys):
    """A Llama 3.x Hugging Face directory (llama3 rope scaling, tied lm_head, tokenizer.json only) converts to
    Meta's layout and gives transformers' logits."""
    from llama.cli.convert import main

    d, args, state, gen = llama3
    ref = hf_model(state, args, tied=tied)
    hf_dir = tmp_path / "hf"
    ref.save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_text("{}")
    assert main(["hf", str(hf_dir), str(tmp_path / "meta")]) == 0
    assert (tmp_path / "meta" / "tokenizer.json").read_text() == "{}"  # the directory's tokenizer goes along
    params = (tmp_path / "meta" / "params.json").read_text()
    assert '"use_scaled_rope": true' in params and '"rope_theta": 500000.0' in params
    out = Llama.build(str(tmp_path / "meta"), str(LLAMA3_TOKENIZER), max_seq_len=1200, max_batch_size=1)
    prompt = long_prompt(gen, 1050)
    with torch.no_grad():
        torch.testing.assert_close(out.model(torch.tensor([prompt], device=out.device), 0)[0].cpu(),
                                   ref(torch.tensor([prompt])).logits[0],
                                   rtol=0, atol=1e-4)


def vocab_split(state, tmp_path, params_src):
    """Meta's Llama 3 two-shard layout: tok_embeddings split by vocabulary, the rest as Llama 2's shards."""
    for r in range(2):
        part = {}
        for name, t in state.items():
            if name == "tok_embeddings.weight":
                part[name] = t.chunk(2, 0)[r].clone()
            elif t.dim() == 1:
                part[name] = t.clone()
            else:
                part[name] = t.chunk(2, 1 if name.endswith(("wo.weight", "w2.weight")) else 0)[r].clone()
        torch.save(part, tmp_path / f"consolidated.{r:02d}.pth")
    (tmp_path / "params.json").write_text(params_src.read_text())
    return tmp_path


MP_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
from llama import Llama
torch.set_num_threads(1)
tokenizer, out, *dirs = sys.argv[1:]
prompt = json.load(open(out + ".prompt"))
res = {}
for d in dirs:
    g = Llama.build(d, tokenizer, max_seq_len=1200, max_batch_size=2, device="cpu")
    g.tokenizer.stop_tokens = {}
    res[d] = g.generate([prompt, prompt[:20]], max_gen_len=8, temperature=0)[0]
json.dump(res, open(f"{out}.{dist.get_rank()}.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def test_one_and_two_shards_at_world_size_2(llama3, tmp_path):
    """torchrun with 2 gloo ranks: the 1-shard and the vocabulary-split 2-shard checkpoints give the greedy ids of
    one process (positions past 1000 included); so do tied ones (no output.weight), 1 shard and 2 vocabulary-split
    shards, whose output slice each rank cuts from the embedding."""
    import json
    import subprocess
    import sys


    d, args, state, gen = llama3
    (tmp_path / "two").mkdir()
    two = vocab_split(state, tmp_path / "two", d / "params.json")
    tied_state = {k: v for k, v in state.items() if k != "output.weight"}
    tied = tmp_path / "tied"
    save_checkpoint(tied_state, PARAMS, tied)
    (tmp_path / "tied2").mkdir()
    tied2 = vocab_split(tied_state, tmp_path / "tied2", d / "params.json")
    prompt = long_prompt(gen, 1100)
    out = tmp_path / "out"
    (tmp_path / "out.prompt").write_text(json.dumps(prompt))
    (tmp_path / "run.py").write_text(MP_SCRIPT)
    env = rank_env(2)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(tmp_path / "run.py"), str(LLAMA3_TOKENIZER), str(out), str(d), str(two), str(tied),
                           str(tied2)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = Llama.build(str(tied), str(LLAMA3_TOKENIZER), max_seq_len=1200, max_batch_size=2)
    gen.tokenizer.stop_tokens, one.tokenizer.stop_tokens, stops = {}, {}, gen.tokenizer.stop_tokens
    try:
        want = gen.generate([prompt, prompt[:20]], max_gen_len=8, temperature=0)[0]
        want_tied = one.generate([prompt, prompt[:20]], max_gen_len=8, temperature=0)[0]
    finally:
        gen.tokenizer.stop_tokens = stops
    assert want_tied != want  # another output projection: the tied runs are a check of their own
    for rank in range(2):
        res = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert res[str(d)] == want and res[str(two)] == want
        assert res[str(tied)] == want_tied and res[str(tied2)] == want_tied


def test_reshard_a_vocabulary_split_checkpoint(llama3, tmp_path):
    from llama.formats.reshard import reshard

    d, args, state, gen = llama3
    (tmp_path / "two").mkdir()
    two = vocab_split(state, tmp_path / "two", d / "params.json")
    prompt = long_prompt(gen, 30)
    want = gen.model(torch.tensor([prompt], device=gen.device), 0).cpu()
    for shards in (1, 2):
        reshard(two, tmp_path / f"r{shards}", shards)
        g = Llama.build(str(tmp_path / f"r{shards}"), str(d / "tokenizer.model"), max_seq_len=64, max_batch_size=1,
                        verify=True)
        torch.testing.assert_close(g.model(torch.tensor([prompt], device=g.device), 0).cpu(), want, rtol=0, atol=1e-5)
