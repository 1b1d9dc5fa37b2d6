"""Fixed-tile GEMM (llama/kernels/tiled.py): oneDNN called on TILE-row tiles gives every row the same bits at any
row count, so prefix_cache="exact" runs its unquantized products there; a shape whose tiles depend on a row's place
is found by the probe and left to our kernel."""

import hardware
import pytest
import torch
import torch.nn.functional as F

from llama.kernels import cpu
from llama.kernels import dense, invariant, tiled

pytestmark = hardware.KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_give_a_row_the_same_bits_at_any_row_count(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 2048, generator=g).to(dtype)
    x = torch.randn(150, 2048, generator=g).to(dtype)
    if not tiled.takes(w, dtype):
        pytest.skip(f"hardware: oneDNN does not take {dtype} tiles here")
    full = tiled.linear(x, w)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)
    for m in (1, 5, 17, 38, tiled.TILE, tiled.TILE + 1, 2 * tiled.TILE + 3):
        assert torch.equal(tiled.linear(x[:m], w), full[:m]), m
        assert torch.equal(tiled.linear(x[m : m + 1], w), full[m : m + 1]), m
    with invariant.rows():  # the route while row-invariant arithmetic is on
        assert torch.equal(dense.linear(x[:7], w), full[:7])
        assert not dense.ours(w, 7, dtype)


def test_a_shape_whose_tiles_depend_on_the_row_place_goes_to_our_kernel(monkeypatch):
    gemm = tiled._gemm
    monkeypatch.setattr(tiled, "_gemm", lambda rows, w: gemm(rows, w) + 1e-3 * torch.arange(rows.shape[0])[:, None])
    monkeypatch.setattr(tiled, "_probed", {})
    w = torch.randn(512, 512).to(torch.bfloat16)  # MIN_ELEMENTS: a size tiles take
    assert not tiled.probe(w) and not tiled.takes(w, torch.bfloat16)
    x = torch.randn(40, 512).to(torch.bfloat16)
    with invariant.rows():
        assert torch.equal(dense.linear(x, w), cpu.float_linear(x, w))
