"""The compressed branch as square causal attention over virtual rows (``nsa.ops.cmp_sdpa``): the layout
copies, the branch against the float64 reference forward and backward, and the dispatcher's choice of path.
The library kernels themselves (cuDNN, FlashAttention) are checked on the GPU in test_triton_kernels.py."""

from __future__ import annotations

import math

import pytest
import torch

from nsa.ops import NSAParams, cmp_sdpa, reference, triton_path
from nsa.ops.indexing import num_cmp


@pytest.mark.parametrize("S,l,d", [(48, 8, 4), (43, 8, 4), (7, 8, 4), (40, 16, 8)])
def test_layout_round_trip(S: int, l: int, d: int) -> None:  # noqa: E741
    """Rows -> virtual -> rows gives back every position a virtual row holds (the first l-1 get the fill);
    the virtual rows past S-1 are zeros; ``mul`` scales on the way."""
    gen = torch.Generator().manual_seed(3)
    B, HQ, H, D = 2, 6, 2, 5
    x = torch.randn(B, S, HQ, D, generator=gen, dtype=torch.float64)
    m = torch.rand(B, S, HQ, 1, generator=gen, dtype=torch.float64)
    N = num_cmp(S, l, d)
    xv = cmp_sdpa.to_virtual(x, H, l, d, mul=m)
    assert xv.shape == (B, HQ * d, N, D)
    back = torch.full_like(x, 7.0)
    cmp_sdpa.to_rows(xv, back, H, l, d, fill=-1.0)
    held = min(S, l - 1)
    assert (back[:, :held] == -1.0).all()
    assert torch.equal(back[:, held:], (x * m)[:, held:])
    # virtual row i, head (kv, g, r) holds position i*d + l-1 + r of head kv*G + g
    G = HQ // H
    for i in range(N):
        for r in range(d):
            t = i * d + l - 1 + r
            rows = xv.view(B, H, G, d, N, D)[:, :, :, r, i]
            want = (x * m)[:, t].view(B, H, G, D) if t < S else torch.zeros(B, H, G, D, dtype=x.dtype)
            assert torch.equal(rows, want), (i, r)


@pytest.mark.parametrize("S,HQ,H", [(48, 6, 1), (43, 4, 2)])
def test_branch_matches_reference(S: int, HQ: int, H: int) -> None:
    """The branch (plain-torch kernel on the virtual rows) equals the reference's compressed branch in
    float64, output, lse and every gradient (the reference run with gates (1, 0, 0))."""
    gen = torch.Generator().manual_seed(11)
    B, D = 2, 8
    hp = NSAParams(l=8, d=4, l_sel=8, n_sel=2, w=8)
    N = num_cmp(S, hp.l, hp.d)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    q, k_c, v_c = rnd(B, S, HQ, D), rnd(B, N, H, D), rnd(B, N, H, D)
    raw = [torch.randn(B, S, H, D, generator=gen, dtype=torch.float64) for _ in range(4)]
    gates = torch.zeros(B, S, HQ, 3, dtype=torch.float64)
    gates[..., 0] = 1.0
    ref = reference.nsa_attention(q, k_c, v_c, *raw, gates, hp)
    o_v, lse_v = cmp_sdpa.attend(q, k_c, v_c, hp.l, hp.d, D**-0.5, "math")
    out = torch.empty_like(ref)
    with torch.no_grad():  # as inside the NSA op
        lse = cmp_sdpa.take(o_v, lse_v, out, H, hp.l, hp.d)
    assert torch.allclose(out, ref, atol=1e-12)
    assert (lse[:, : hp.l - 1] == math.inf).all() and torch.isfinite(lse[:, hp.l - 1:]).all()
    # lse (log2 domain) of one row, by hand
    t, h = S - 1, HQ - 1
    s = (q[0, t, h] @ k_c[0, : (t + 1 - hp.l) // hp.d + 1, h // (HQ // H)].T) * D**-0.5
    assert lse.dtype == torch.float32 and abs(float(lse[0, t, h]) - float(torch.logsumexp(s, 0)) / math.log(2)) < 1e-5
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(ref, (q, k_c, v_c), g)
    d_ov = cmp_sdpa.grad_out(g, torch.ones(B, S, HQ, dtype=torch.float64), H, hp.l, hp.d)
    got = torch.autograd.grad(o_v, (q, k_c, v_c), d_ov)
    for name, a, b in zip(("q", "k_cmp", "v_cmp"), got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-12), name


def test_dispatcher_picks_the_path_by_shape() -> None:
    """cuDNN on Hopper from 16k with 16+ heads per group and from 32k otherwise; our kernel for short
    sequences, queries at an offset, head dims over 128 or unequal, and GPUs before Hopper; a set path
    serves where it can."""
    pick = triton_path.cmp_path_for
    n = 4096
    assert pick(65536, 6, 64, 64, n, True, 9) == "cudnn"
    assert pick(16384, 16, 128, 128, n, True, 9) == "cudnn"
    assert pick(16384, 6, 64, 64, n, True, 9) == "kernel"
    assert pick(65536, 6, 64, 64, n, True, 8) == "kernel"
    assert pick(65536, 6, 64, 64, n, False, 9) == "kernel"  # queries at an offset, or fewer than the keys
    assert pick(65536, 6, 192, 128, n, True, 9) == "kernel"
    assert pick(65536, 6, 256, 256, n, True, 9) == "kernel"
    assert pick(65536, 6, 64, 64, n, True, 0) == "kernel"
    assert triton_path.cmp_path_of_shape(65536, 12, 2, 64, NSAParams(), torch.device("cpu")) == "kernel"
    q = torch.zeros(1, 48, 4, 8)
    k_c = torch.zeros(1, num_cmp(48, 8, 4), 2, 8)
    try:
        triton_path.set_cmp_path("flash")
        assert pick(2048, 6, 64, 64, 127, True, 8) == "flash"
        assert pick(2048, 6, 64, 64, 127, True, 0) == "kernel"  # a library kernel needs the GPU
        triton_path.set_cmp_path("math")
        assert pick(2048, 6, 64, 64, 127, True, 0) == "math"
        assert pick(2048, 6, 64, 64, 127, False, 0) == "kernel"
        assert triton_path.cmp_path(q, k_c, k_c, 0) == triton_path.cmp_path(q, k_c, k_c, 0, 48) == "math"
        assert triton_path.cmp_path(q, k_c, k_c, 16) == triton_path.cmp_path(q, k_c, k_c, 0, 64) == "kernel"
    finally:
        triton_path.set_cmp_path(None)
    with pytest.raises(ValueError, match="choose one of auto, kernel, cudnn, flash, math"):
        triton_path.set_cmp_path("fast")
