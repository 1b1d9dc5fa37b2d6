"""The example scripts run as plain python and under torchrun, on the shared model and on the demo checkpoint.
(The default model they fetch is tested in test_fetch.py.)"""

import subprocess
import sys

from conftest import REPO, fresh_cache, rank_env


def run(args, tmp_path, **env_extra):
    env = rank_env(1, LLAMA_CACHE=str(fresh_cache(tmp_path / "cache")), **env_extra)
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]


# Plain `python example_*.py` runs in the tests below (streamed vs batch, items that do not fit); these are the
# reference's torchrun invocations.
def test_text_example_on_stories(stories_dir, tmp_path):
    out = run(TORCHRUN + ["example_text_completion.py", "--ckpt_dir", str(stories_dir), "--temperature", "0",
                          "--max_gen_len", "16"], tmp_path)
    assert out.count("==================================") == 4
    assert "I believe the meaning of life is" in out


def test_chat_example_on_stories(stories_dir, tmp_path):
    out = run(TORCHRUN + ["example_chat_completion.py", "--ckpt_dir", str(stories_dir), "--max_seq_len", "1024",
                          "--max_gen_len", "16", "--seed", "3"], tmp_path)
    assert out.count("==================================") == 6
    assert "Error: special tags are not allowed as part of the prompt." in out


def test_examples_on_demo_checkpoint_with_streaming(tmp_path):
    out = run([sys.executable, "example_text_completion.py", "--max_gen_len", "8", "--stream"], tmp_path,
              LLAMA_OFFLINE="1")
    assert "LLAMA_OFFLINE is set" in out and "random weights, so its text is meaningless" in out
    assert (tmp_path / "cache" / "demo" / "checklist.chk").is_file()  # built once, cached
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()  # nothing fetched
    out = run(TORCHRUN + ["example_chat_completion.py", "--max_gen_len", "8"], tmp_path, LLAMA_OFFLINE="1")
    assert out.count("> Assistant:") == 6


def test_items_that_do_not_fit_are_reported_and_the_others_run(stories_dir, tmp_path):
    """Both output paths: the chat example streamed, the text example batched."""
    out = run([sys.executable, "example_chat_completion.py", "--ckpt_dir", str(stories_dir), "--max_seq_len", "500",
               "--max_gen_len", "8", "--temperature", "0", "--stream"], tmp_path)
    skipped = [line for line in out.splitlines() if "(not run: " in line]
    assert len(skipped) == 1, out  # the long Paris dialog (589 tokens with stories260K's 512-piece vocabulary)
    assert "dialog 1 has 589 tokens, which does not fit max_seq_len=500" in skipped[0]
    assert out.count("> Assistant:") == 6 and "Error: special tags are not allowed" in out
    out = run([sys.executable, "example_text_completion.py", "--ckpt_dir", str(stories_dir), "--max_seq_len", "40",
               "--max_gen_len", "4"], tmp_path)
    assert out.count("(not run: prompt ") == 2 and "prompt 3 has 94 tokens" in out, out
    assert out.count("==================================") == 4


def test_streamed_example_matches_batch_output(stories_dir, tmp_path):
    args = ["example_text_completion.py", "--ckpt_dir", str(stories_dir), "--temperature", "0", "--max_gen_len", "24"]
    batch = run([sys.executable] + args, tmp_path)
    streamed = run([sys.executable] + args + ["--stream"], tmp_path)
    first_batch = batch.split("I believe the meaning of life is\n> ", 1)[1].split("\n", 1)[0]
    first_stream = streamed.split("I believe the meaning of life is", 1)[1].split("\n", 1)[0]
    assert first_stream == first_batch


def test_chat_example_on_a_llama3_checkpoint(tmp_path):
    """The same script with a Llama 3 checkpoint: the tokenizer file picks the header format, and a tool turn is
    added to the dialogs; streamed replies equal the batch's (seeded)."""
    from conftest import SHARED, need

    from llama.hub.demo import write_random_checkpoint

    tokenizer = need(SHARED / "tokenizers" / "llama3" / "tokenizer.model")
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "norm_eps": 1e-5,
              "rope_theta": 500000.0, "use_scaled_rope": True, "vocab_size": 128256}
    write_random_checkpoint(tmp_path / "l3", params, tokenizer_path=tokenizer)
    args = [sys.executable, "example_chat_completion.py", "--ckpt_dir", str(tmp_path / "l3"), "--max_gen_len", "6",
            "--max_seq_len", "1024", "--seed", "5"]
    out = run(args, tmp_path)
    assert out.count("> Assistant:") == 7 and "Tool: 1024" in out and "Error: special tags" not in out
    texts = lambda o: [line for line in o.splitlines() if not line.startswith("Loaded in")]  # noqa: E731
    assert texts(run(args + ["--stream"], tmp_path)) == texts(out)


def test_chat_example_on_the_shared_gguf(tmp_path):
    """A GGUF file needs no --tokenizer_path: its tokenizer and chat template come from the file."""
    from conftest import SHARED, need

    gguf = need(SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    out = run([sys.executable, "example_chat_completion.py", "--ckpt_dir", str(gguf), "--max_gen_len", "4",
               "--max_seq_len", "1024", "--temperature", "0", "--compile", "False"], tmp_path)
    assert out.count("> Assistant:") == 6 and "Error: special tags" not in out
