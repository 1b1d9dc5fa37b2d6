"""How much an arithmetic changes what a GGUF file's model says, against the same file dequantized to fp32.

    python -m benchmarks quality [FILE.gguf] [--tokens 10240] [--window 512] [--llamacpp]
        [--arith int16 float int8] [--workdir DIR]

Per arithmetic (ours "int16": int16 activation blocks, the default; ours "float": fp32 activations; ours "int8":
llama.cpp's int8 activation blocks; "llama.cpp": llama-cpp-python's own logits on the same file, with --llamacpp), over at least --tokens tokens of real
English text (the Python reference manual's topics shipped in the standard library, `pydoc_data.topics`, the same
text on every machine), in windows of --window tokens scored teacher-forced (ours with every row in the row kernel
a decode step runs, llama/kernels/invariant.py, not the fp32 GEMM a long prompt takes):
- KL divergence per token, KL(reference || arithmetic) in nats, mean with its standard error and 99th percentile;
- top-1 agreement: how often the arithmetic's argmax is the reference's, with its standard error;
- greedy answers to 24 factual questions (chat template, temperature 0, 32 tokens): how many are the
  reference's answer word for word, and how many name the expected answer.
The reference is the file loaded with LLAMA_GGUF_BLOCKS=0 (every tensor dequantized to fp32). Its log-probabilities
go to a float32 file in --workdir, so one model is in memory at a time. With no FILE, the shared SmolLM2-135M-Instruct
Q4_1 file.
"""

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import harness  # noqa: E402

SHARED_Q4_1 = REPO.parent / "shared" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# (question, a word the right answer names): easy facts a chat model of any size should know
QUESTIONS = [
    ("What is the capital of France?", "Paris"), ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Japan?", "Tokyo"), ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"), ("What is the capital of the United Kingdom?", "London"),
    ("What is the largest planet in the solar system?", "Jupiter"), ("How many days are in a week?", "seven|7"),
    ("What is the chemical symbol for water?", "H2O|H₂O"), ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("What color is the sky on a clear day?", "blue"), ("How many legs does a spider have?", "eight|8"),
    ("What is the boiling point of water in degrees Celsius?", "100"), ("What is 2 plus 2?", "4|four"),
    ("Which planet is known as the Red Planet?", "Mars"), ("What is the largest ocean on Earth?", "Pacific"),
    ("Who painted the Mona Lisa?", "Leonardo|Vinci"), ("What gas do plants absorb from the air?", "carbon dioxide|CO2"),
    ("What is the freezing point of water in degrees Celsius?", "0|zero"), ("How many continents are there?", "seven|7"),
    ("What is the tallest mountain in the world?", "Everest"), ("What language is spoken in Brazil?", "Portuguese"),
    ("Who was the first person to walk on the Moon?", "Armstrong"), ("What is the square root of 81?", "9|nine"),
]


LABELS = {"int16": "ours, int16 activations (default)", "float": "ours, fp32 activations",
          "int8": "ours, int8 activations"}


def english_text(chars: int) -> str:
    """The first `chars` characters of the Python reference manual's topics, in their sorted order."""
    from pydoc_data.topics import topics

    out, n = [], 0
    for key in sorted(topics):
        out.append(topics[key])
        n += len(topics[key])
        if n >= chars:
            break
    return "\n\n".join(out)[:chars]


def token_windows(tok, tokens: int, window: int):
    """At least `tokens` scored tokens as windows of `window` token ids each."""
    ids = tok.encode(english_text(tokens * 8), bos=False, eos=False)
    count = math.ceil(tokens / (window - 1))
    if len(ids) < count * window:
        raise SystemExit(f"the text gives {len(ids)} tokens, fewer than {count * window}")
    return [ids[i * window : (i + 1) * window] for i in range(count)]


def build(path: Path, arith: str):
    """Our model of the file with this arithmetic: 'reference' (every tensor dequantized to fp32), 'int16', 'float',
    'int8'."""
    from llama import Llama, settings

    os.environ["LLAMA_GGUF_BLOCKS"] = "0" if arith == "reference" else "1"
    os.environ["LLAMA_GGUF_ACTIVATIONS"] = "float" if arith == "reference" else arith
    settings.reset()
    return Llama.build(str(path), None, max_seq_len=1024, max_batch_size=len(QUESTIONS), compile=False,
                       dtype="float32")


def our_logprobs(gen, window, rows: bool = False):
    """Log-probabilities of each next token; rows: every position through the row kernel of a decode step."""
    import torch

    from llama.kernels import invariant

    with gen.cache.hold(), invariant.rows(rows):
        logits = gen.runner.logits([window])[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def peer_logprobs(llm, window):
    import torch

    llm.reset()
    llm.eval(window)
    logits = torch.from_numpy(np.array(llm.scores[: len(window) - 1], dtype=np.float32))
    return torch.log_softmax(logits, dim=-1)


def compare(ref_file: np.memmap, windows, logprobs) -> dict:
    """KL(reference || these) per token and top-1 agreement, over every scored position of every window."""
    import torch

    kls, agree, row = [], [], 0
    for w in windows:
        lp = logprobs(w)
        ref = torch.from_numpy(np.asarray(ref_file[row : row + lp.shape[0]]))
        row += lp.shape[0]
        kls.append((ref.exp() * (ref - lp)).sum(-1).clamp_min(0).double())
        agree.append((ref.argmax(-1) == lp.argmax(-1)).double())
    kl, top1 = torch.cat(kls), torch.cat(agree)
    n = kl.numel()
    return {"tokens": n, "kl_mean": kl.mean().item(), "kl_se": (kl.std() / math.sqrt(n)).item(),
            "kl_p99": kl.quantile(0.99).item(), "top1": top1.mean().item(),
            "top1_se": (top1.std() / math.sqrt(n)).item()}


def our_answers(gen) -> list:
    out = gen.chat_completion([[{"role": "user", "content": q}] for q, _ in QUESTIONS], temperature=0, max_gen_len=32)
    return [o["generation"]["content"].strip() for o in out]


def peer_answers(llm, gen) -> list:
    """llama.cpp's greedy answers to our rendering of the same chat prompts (the same prompt token ids)."""
    from benchmarks.gguf_agreement import peer_greedy

    answers = []
    for q, _ in QUESTIONS:
        prompt, _ = gen.inputs.encode_dialog([{"role": "user", "content": q}])
        ids = peer_greedy(llm, prompt, 32, gen.tokenizer.eos_id)
        stops = [i for i, t in enumerate(ids) if t in gen.tokenizer.stop_tokens]
        answers.append(gen.tokenizer.decode(ids[: stops[0]] if stops else ids).strip())
    return answers


def score_answers(answers, reference) -> dict:
    import re

    same = sum(a == r for a, r in zip(answers, reference))
    right = sum(bool(re.search(rf"\b({k})\b", a, re.I)) for a, (_, k) in zip(answers, QUESTIONS))
    return {"answers_same": f"{same}/{len(answers)}", "answers_right": f"{right}/{len(answers)}",
            "same_share": same / len(answers)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", nargs="?", default=str(SHARED_Q4_1))
    p.add_argument("--tokens", type=int, default=10240)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--arith", nargs="+", default=list(LABELS), choices=list(LABELS))
    p.add_argument("--llamacpp", action="store_true", help="also llama.cpp's logits (llama-cpp-python)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import tempfile

    import torch
    from tqdm import tqdm

    torch.set_num_threads(a.threads)
    path = Path(a.file)
    with tempfile.TemporaryDirectory() as tmp:
        work = harness.workdir(a.workdir, tmp)
        gen = build(path, "reference")
        windows = token_windows(gen.tokenizer, a.tokens, a.window)
        vocab = our_logprobs(gen, windows[0][:2]).shape[-1]
        ref = np.lib.format.open_memmap(work / "reference_logprobs.npy", "w+", np.float32,
                                        (len(windows) * (a.window - 1), vocab))
        row = 0
        for w in tqdm(windows, desc="reference (fp32 dequantized)", unit="window"):
            lp = our_logprobs(gen, w)
            ref[row : row + lp.shape[0]] = lp.numpy()
            row += lp.shape[0]
        ref_answers = our_answers(gen)
        del gen
        rows = [{"arithmetic": "reference: fp32 dequantized", **score_answers(ref_answers, ref_answers)}]
        answers = {"reference": ref_answers}
        for arith in a.arith:
            gen = build(path, arith)
            stats = compare(ref, tqdm(windows, desc=f"ours, {arith}", unit="window"),
                            lambda w: our_logprobs(gen, w, rows=True))
            answers[arith] = our_answers(gen)
            rows.append({"arithmetic": LABELS[arith], **stats, **score_answers(answers[arith], ref_answers)})
            del gen
        if a.llamacpp:
            import llama_cpp

            gen = build(path, "int16")  # for the chat prompts' token ids only
            llm = llama_cpp.Llama(str(path), n_ctx=max(a.window, 256), n_batch=a.window, n_threads=a.threads,
                                  logits_all=True, verbose=False)
            stats = compare(ref, tqdm(windows, desc="llama.cpp", unit="window"), lambda w: peer_logprobs(llm, w))
            answers["llama.cpp"] = peer_answers(llm, gen)
            rows.append({"arithmetic": "llama.cpp", **stats, **score_answers(answers["llama.cpp"], ref_answers)})
        for row in rows:
            for k in ("kl_mean", "kl_se", "kl_p99"):
                if k in row:
                    row[k] = f"{row[k]:.2e}"
            for k in ("top1", "top1_se"):
                if k in row:
                    row[k] = f"{100 * row[k]:.2f}%"
        harness.print_results(f"quality of {path.name} against its fp32 dequantization", rows, a.json,
                              {"answers": {k: dict(zip([q for q, _ in QUESTIONS], v)) for k, v in answers.items()}})
        for name, ans in answers.items():
            print(f"\n{name}:")
            for (q, _), ans_ in zip(QUESTIONS, ans):
                print(f"- {q} -> {ans_[:80]!r}")


if __name__ == "__main__":
    main()
