"""Small random-weight Hugging Face directories of the LLaMA-style families, written by transformers itself
(`AutoModelForCausalLM.from_config(...).save_pretrained`), with a small sentencepiece tokenizer.model trained here
(llama.cpp's converter reads it for every family). fp32, 2 layers, head_dim 16 (our kernels take it)."""

import io
import random
import shutil
from pathlib import Path

import torch

VOCAB = 128
EOS = 2
COMMON = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
              initializer_range=0.1, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
_SHORT = [1.0 + 0.1 * i for i in range(8)]
_LONG = [1.0 + 0.9 * i for i in range(8)]
# name -> (model_type, config overrides): each family's differences, at sizes the tests pass beyond
FAMILIES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": 24}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "phi3": ("phi3", {}),
    "phi3-longrope": ("phi3", {"original_max_position_embeddings": 128, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": _SHORT, "long_factor": _LONG}}),
    "granite": ("granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                            "attention_multiplier": 0.015625, "logits_scaling": 8.0}),
    "llama3": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}}),
    "llama-yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 128}}),
    # qk-norm; head_dim set apart from hidden_size / heads, as Qwen3's own configs do
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    # 8 experts, top 2 renormalised, experts narrower than the dense FFN width (llama.cpp's converter takes no
    # dense layers in a qwen3moe: HF_ONLY's qwen3moe-mixed has them)
    "qwen3moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                               "norm_topk_prob": True}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
MOE = ("qwen3moe", "mixtral")
# families only a Hugging Face directory holds: a dense layer among MoE ones (mlp_only_layers, decoder_sparse_step),
# and the top-k weights left as the softmax gave them (norm_topk_prob false)
HF_ONLY = {
    "qwen3moe-mixed": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "norm_topk_prob": False, "mlp_only_layers": [0], "decoder_sparse_step": 1,
                                     "num_hidden_layers": 3}),
    # wide enough for K-quant super-blocks (256 values): llama.cpp's Q4_K_M quantizes these (tests/formats/
    # test_gguf_moe.py), 8 heads of 64 so attention splits at whole blocks; Qwen3-MoE's experts are 768 wide as Qwen3-30B-A3B's are (3 blocks: 2 ranks split 2 + 1)
    "qwen3moe-k": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 768,
                                 "norm_topk_prob": True, "hidden_size": 256, "head_dim": 64,
                                 "num_attention_heads": 8}),
    "mixtral-k": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "hidden_size": 256,
                              "intermediate_size": 512, "head_dim": 64, "num_attention_heads": 8}),
}


def sentencepiece_model() -> bytes:
    """A 128-piece BPE sentencepiece model trained on a few hundred lines of made-up text."""
    import sentencepiece as spm

    words = ("the a cat dog runs jumps over lazy quick brown fox hello world once upon time little girl named lily "
             "sun moon star tree").split()
    r = random.Random(0)
    text = [" ".join(r.choice(words) for _ in range(12)) for _ in range(400)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=VOCAB, model_type="bpe",
                                   character_coverage=1.0, bos_id=1, eos_id=EOS, unk_id=0, pad_id=-1,
                                   minloglevel=2)
    return buf.getvalue()


def hf_model(name: str, seed: int = 0):
    """transformers' model of family `name` with seeded random weights, fp32, in eval mode."""
    import transformers

    model_type, extra = {**FAMILIES, **HF_ONLY}[name]
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: random ones, so the tests see them
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def write_hf(name: str, out: Path, sp_model: bytes, seed: int = 0, **save_kwargs):
    """(directory, transformers model): family `name` saved by transformers, with tokenizer.model beside it."""
    model = hf_model(name, seed)
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, **save_kwargs)
    (out / "tokenizer.model").write_bytes(sp_model)
    return out, model


def hf_greedy(model, prompt, n: int) -> list:
    """transformers' greedy ids after prompt, without a cache (each step a full forward), cut before EOS."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            if nxt == EOS:
                break
            seq.append(nxt)
    return seq[len(prompt):]


def sequence(length: int, seed: int = 1) -> list:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def our_logits(g, seq):
    """Every position's logits of `seq` from Llama g (fp32 on the CPU), compared with transformers' in the tests."""
    with g.cache.hold():
        return g.runner.logits([seq])[0].cpu()


def write_byte_level_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer.json of VOCAB tokens (Qwen's kind, which llama.cpp's converter reads for
    Qwen3-MoE): <unk>, <s>, </s>, the printable ASCII bytes, Ġ (a space) and merges of common pairs; with
    tokenizer_config.json naming its BOS and EOS."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(33, 127)] + ["Ġ"]
    merges = []
    for a, b in (("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("e", "r"), ("o", "n"), ("Ġt", "he"), ("r", "e"),
                 ("a", "t"), ("e", "n"), ("o", "r"), ("Ġ", "s"), ("e", "d"), ("Ġ", "w"), ("i", "s"), ("Ġ", "c"),
                 ("a", "n"), ("i", "t"), ("Ġ", "b"), ("o", "u"), ("Ġ", "f"), ("a", "r"), ("Ġ", "o"), ("Ġ", "d"),
                 ("Ġ", "l"), ("Ġ", "m"), ("Ġ", "p"), ("e", "s"), ("l", "l"), ("Ġ", "h"), ("Ġ", "r"), ("Ġ", "n")):
        if len(pieces) < VOCAB:
            pieces.append(a + b)
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    out = Path(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "bos_token": "<s>", "eos_token": "</s>",
                                                           "unk_token": "<unk>", "add_bos_token": False}))


# llama.cpp's converter reads a byte-level BPE vocabulary (Qwen3-MoE's, Llama 4's) and names its pre-tokenizer by
# hashing how it splits a fixed text, which only a real vocabulary matches: for write_byte_level_tokenizer's random
# one the run is told it is Qwen2's, in its own process only. The tensors and metadata tests check are the
# converter's own.
BPE_RUN = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_command(converter: Path, hf_dir: Path, bpe: bool) -> list:
    """The command line (before the converter's own arguments) that runs llama.cpp's convert_hf_to_gguf.py on
    hf_dir: with bpe, through BPE_RUN (written beside hf_dir)."""
    import sys

    if not bpe:
        return [sys.executable, str(converter), str(hf_dir)]
    run = Path(hf_dir).parent / "bpe_run.py"
    run.write_text(BPE_RUN)
    return [sys.executable, str(run), str(converter.parent), str(converter), str(hf_dir)]
