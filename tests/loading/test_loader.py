"""loader.fuses: when loading fuses q/k/v and gate/up (a copy of those weights) and when it keeps them apart."""

import torch

from llama.loading import loader, memory
from llama.kernels import cpu
from llama.model import ModelArgs

SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16)
LLAMA2_7B = ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256)  # fused copy: 9 GB bf16


def test_a_large_unquantized_cpu_model_stays_unfused_where_our_kernels_run(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 24 * 2**30)
    host = torch.device("cpu")
    assert loader.fuses(SMALL, torch.bfloat16, host, None, "auto")  # a small copy: fewer products pay
    big = loader.fuses(LLAMA2_7B, torch.bfloat16, host, None, "auto")
    assert big is not cpu.available()  # 9 GB of 24: unfused where our kernels stream each weight
    assert loader.fuses(LLAMA2_7B, torch.bfloat16, host, None, "auto", ranks=4)  # each rank's share is small
    assert loader.fuses(LLAMA2_7B, torch.bfloat16, host, "int4", "auto")  # quantized: fused, then packed
    # a compiled step calls our kernels on the weights, fused or not; under model parallel its graph freezes a copy
    assert loader.fuses(LLAMA2_7B, torch.bfloat16, host, None, True) is big
    monkeypatch.setattr(memory, "available_bytes", lambda: 8 * 2**30)  # each rank's 4.5 GB share is over a quarter
    assert loader.fuses(LLAMA2_7B, torch.bfloat16, host, None, "auto", ranks=2) is not cpu.available()
    assert loader.fuses(LLAMA2_7B, torch.bfloat16, host, None, True, ranks=2)
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert loader.fuses(LLAMA2_7B, torch.bfloat16, host, None, "auto")  # PyTorch's kernels: one product is faster
