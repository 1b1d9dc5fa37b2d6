"""Text completion with a pretrained Llama: `torchrun --nproc_per_node 1 example_text_completion.py --ckpt_dir ...`.

Also runs as plain `python example_text_completion.py`; with no --ckpt_dir it uses a random demo checkpoint.
"""

from typing import Optional, Union

import fire

from llama.demo import build_for_example


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    temperature: float = 0.6,
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
):
    generator = build_for_example(ckpt_dir, tokenizer_path, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                                  verify=verify, quantize=quantize, compile=compile, dtype=dtype,
                                  pipeline_parallel_size=pipeline_parallel_size)
    prompts = [
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
    if stream:
        for prompt in prompts:
            print(prompt, end="", flush=True)
            for delta in generator.stream_completion(prompt, temperature=temperature, top_p=top_p,
                                                     max_gen_len=max_gen_len, seed=seed):
                print(delta, end="", flush=True)
            print("\n==================================\n")
        return
    results = generator.text_completion(prompts, max_gen_len=max_gen_len, temperature=temperature, top_p=top_p,
                                        seed=seed)
    for prompt, result in zip(prompts, results):
        print(prompt)
        print(f"> {result['generation']}")
        print("\n==================================\n")


if __name__ == "__main__":
    fire.Fire(main)
