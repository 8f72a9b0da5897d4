"""The compressed branch as square causal attention over virtual rows (``nsa.ops.cmp_sdpa``): the layout
copies, the branch against the float64 reference forward and backward, and the dispatcher's choice of path.
The library kernels themselves (cuDNN, FlashAttention) are checked on the GPU in test_triton_kernels.py."""

from __future__ import annotations

import math

import pytest
import torch

from nsa.ops import NSAParams, cmp_sdpa, reference, tile_overrides, triton_path
from nsa.ops.indexing import num_cmp


@pytest.mark.parametrize("S,l,d,q_start", [(48, 8, 4, 0), (43, 8, 4, 0), (7, 8, 4, 0), (40, 16, 8, 0),
                                           (20, 8, 4, 13), (21, 8, 4, 12), (3, 8, 4, 30), (17, 8, 4, 7),
                                           (5, 8, 4, 2)])
def test_layout_round_trip(S: int, l: int, d: int, q_start: int) -> None:  # noqa: E741
    """Rows at positions ``q_start ..`` -> virtual -> rows gives back every position a virtual row holds
    (positions before l-1 get the fill); the virtual slots no row fills (past S-1, or before ``q_start`` in
    a first row shared with earlier queries) are zeros; ``mul`` scales on the way."""
    gen = torch.Generator().manual_seed(3)
    B, HQ, H, D = 2, 6, 2, 5
    x = torch.randn(B, S, HQ, D, generator=gen, dtype=torch.float64)
    m = torch.rand(B, S, HQ, 1, generator=gen, dtype=torch.float64)
    n0, origin, N = cmp_sdpa.geometry(S, l, d, q_start)
    assert n0 + N == num_cmp(q_start + S, l, d)  # the keys up to the last query
    xv = cmp_sdpa.to_virtual(x, H, l, d, mul=m, q_start=q_start)
    assert xv.shape == (B, HQ * d, N, D)
    back = torch.full_like(x, 7.0)
    cmp_sdpa.to_rows(xv, back, H, l, d, fill=-1.0, q_start=q_start)
    held = max(0, min(S, origin))
    assert (back[:, :held] == -1.0).all()
    assert torch.equal(back[:, held:], (x * m)[:, held:])
    # virtual row i, head (kv, g, r) holds position (n0 + i)*d + l-1 + r of head kv*G + g
    G = HQ // H
    for i in range(N):
        for r in range(d):
            row = (n0 + i) * d + l - 1 + r - q_start
            got = xv.view(B, H, G, d, N, D)[:, :, :, r, i]
            want = (x * m)[:, row].view(B, H, G, D) if 0 <= row < S else torch.zeros(B, H, G, D, dtype=x.dtype)
            assert torch.equal(got, want), (i, r)


@pytest.mark.parametrize("S,HQ,H,q_start", [(48, 6, 1, 0), (43, 4, 2, 0), (53, 6, 2, 5), (53, 6, 2, 13),
                                             (53, 4, 2, 33)])
def test_branch_matches_reference(S: int, HQ: int, H: int, q_start: int) -> None:
    """The branch (plain-torch kernels on the virtual rows) equals the reference's compressed branch in
    float64, output, lse and every gradient (the reference run with gates (1, 0, 0)); queries at an offset
    (``q_start``: the last ``S - q_start`` positions, a context-parallel chunk) run as the library kernels
    would, a rectangle and a causal square merged by their log-sum-exps, each part's backward from the
    merged output."""
    gen = torch.Generator().manual_seed(11)
    B, D = 2, 8
    hp = NSAParams(l=8, d=4, l_sel=8, n_sel=2, w=8)
    N = num_cmp(S, hp.l, hp.d)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    q_all, k_c, v_c = rnd(B, S, HQ, D), rnd(B, N, H, D), rnd(B, N, H, D)
    raw = [torch.randn(B, S, H, D, generator=gen, dtype=torch.float64) for _ in range(4)]
    gates = torch.zeros(B, S, HQ, 3, dtype=torch.float64)
    gates[..., 0] = 1.0
    ref = reference.nsa_attention(q_all, k_c, v_c, *raw, gates, hp)[:, q_start:]
    q = q_all.detach()[:, q_start:].clone().requires_grad_(True)
    assert (cmp_sdpa.geometry(q.shape[1], hp.l, hp.d, q_start)[0] > 0) == (q_start >= 12)  # the split ran
    o_v, lse_v = cmp_sdpa.attend(q, k_c, v_c, hp.l, hp.d, D**-0.5, "math", q_start=q_start)
    out = torch.empty_like(ref)
    with torch.no_grad():  # as inside the NSA op
        lse = cmp_sdpa.take(o_v, lse_v, out, H, hp.l, hp.d, q_start=q_start)
    assert torch.allclose(out, ref, atol=1e-12)
    no_token = max(0, hp.l - 1 - q_start)
    assert (lse[:, :no_token] == math.inf).all() and torch.isfinite(lse[:, no_token:]).all()
    # lse (log2 domain) of one row, by hand
    t, h = S - 1, HQ - 1
    s = (q_all[0, t, h] @ k_c[0, : (t + 1 - hp.l) // hp.d + 1, h // (HQ // H)].T).detach() * D**-0.5
    assert lse.dtype == torch.float32 and abs(float(lse[0, -1, h]) - float(torch.logsumexp(s, 0)) / math.log(2)) < 1e-5
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(ref, (q_all, k_c, v_c), g)
    d_ov = cmp_sdpa.grad_out(g, torch.ones(B, S - q_start, HQ, dtype=torch.float64), H, hp.l, hp.d, q_start=q_start)
    got = torch.autograd.grad(o_v, (q, k_c, v_c), d_ov)
    for name, a, b in zip(("q", "k_cmp", "v_cmp"), got, (want[0][:, q_start:], *want[1:]), strict=True):
        assert torch.allclose(a, b, atol=1e-12), name
    if q_start >= 12 and H > 1:  # the library path's backward one KV head per call (tile key cmp_bwd_mib=0)
        with tile_overrides({"cmp_bwd_mib": 0}):
            o_v, _ = cmp_sdpa.attend(q, k_c, v_c, hp.l, hp.d, D**-0.5, "math", q_start=q_start)
            got = torch.autograd.grad(o_v, (q, k_c, v_c), d_ov)
        for name, a, b in zip(("q", "k_cmp", "v_cmp"), got, (want[0][:, q_start:], *want[1:]), strict=True):
            assert torch.allclose(a, b, atol=1e-12), (name, "one KV head per call")


def test_backward_chunks_by_kv_heads() -> None:
    """The library's backward runs as many KV heads per call as keep the virtual ``q`` within ``cmp_bwd_mib``."""
    paper_64k = (1, 16 * 16, 65536 // 16, 128, 2, 4)  # B, virtual heads per KV head, N, D, bytes, H
    assert cmp_sdpa.bwd_heads(*paper_64k) == 1  # 256 MiB a KV head: four calls
    assert cmp_sdpa.bwd_heads(1, 256, 1024, 128, 2, 4) == 4  # 16k: one call
    assert cmp_sdpa.bwd_heads(1, 256, 2048, 128, 2, 4) == 2
    with tile_overrides({"cmp_bwd_mib": 0}):
        assert cmp_sdpa.bwd_heads(1, 1, 1, 1, 2, 4) == 1
    with tile_overrides({"cmp_bwd_mib": 4096}):
        assert cmp_sdpa.bwd_heads(*paper_64k) == 4


@pytest.mark.parametrize("q_start", [0, 24])
def test_library_function_compiles(q_start: int) -> None:
    """The library branch's ``autograd.Function`` traced whole by Dynamo (``fullgraph``) gives eager's output and
    gradients (seed 3). At ``q_start = 0`` it returned one seed tensor twice, which broke Dynamo's saved-tensor wiring
    (compiled training from 32k, where the branch takes cuDNN, failed with ``assert node in env``)."""
    torch.manual_seed(3)
    B, S, HQ, H, D, l, d = 1, 48, 4, 2, 8, 8, 4  # noqa: E741
    N = num_cmp(q_start + S, l, d)
    q = torch.randn(B, S, HQ, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o, lse, *_ = cmp_sdpa._Library.apply(q, k, v, l, d, D**-0.5, "math", q_start)
        return (o**2).sum() + lse[torch.isfinite(lse)].sum()

    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "flash"])
def test_backward_by_kv_heads_gpu(impl: str) -> None:
    """On the GPU, the library's backward one KV head per call gives the gradients of one call (batch 2, whole
    sequence and a chunk at an offset: the strided slices the library kernels are handed; skipped without
    CUDA by the ``gpu`` marker, tests/conftest.py)."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    B, S, HQ, H, D = 2, 1024, 8, 2, 64
    hp = NSAParams()
    for q_start in (0, 1024):
        N = num_cmp(q_start + S, hp.l, hp.d)
        q, k_c, v_c = (torch.randn(*s, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
                       for s in ((B, S, HQ, D), (B, N, H, D), (B, N, H, D)))
        grads = []
        for tune in ({}, {"cmp_bwd_mib": 0}):
            with tile_overrides(tune):
                o_v, _ = cmp_sdpa.attend(q, k_c, v_c, hp.l, hp.d, D**-0.5, impl, q_start=q_start)
                g = torch.randn(o_v.shape, generator=gen.manual_seed(5), device="cuda", dtype=o_v.dtype)
                grads.append(torch.autograd.grad(o_v, (q, k_c, v_c), g))
        for name, a, b in zip(("q", "k_cmp", "v_cmp"), *grads, strict=True):
            err = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
            assert err < 1e-2, (impl, q_start, name, err)


def test_dispatcher_picks_the_path_by_shape() -> None:
    """cuDNN on Hopper from 16k with 16+ heads per group and from 32k otherwise (whole sequences, and chunks
    at an offset whose keys end with them); our kernel for short sequences, queries that end before the
    keys, head dims over 128 or unequal, and GPUs before Hopper; a set path serves where it can."""
    pick = triton_path.cmp_path_for
    n = 4096
    assert pick(65536, 6, 64, 64, n, True, 9) == "cudnn"
    assert pick(16384, 16, 128, 128, n, True, 9) == "cudnn"
    assert pick(16384, 6, 64, 64, n, True, 9) == "kernel"
    assert pick(65536, 6, 64, 64, n, True, 8) == "kernel"
    assert pick(65536, 6, 64, 64, n, False, 9) == "kernel"  # queries that end before the keys
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
        # a chunk at an offset whose keys end with it (context parallelism) can take a library kernel
        k_64 = torch.zeros(1, num_cmp(64, 8, 4), 2, 8)
        assert triton_path.cmp_path(q, k_64, k_64, 16, 64) == "math"
    finally:
        triton_path.set_cmp_path(None)
    with pytest.raises(ValueError, match="choose one of auto, kernel, cudnn, flash, math"):
        triton_path.set_cmp_path("fast")


def _regroup_case(device: str = "cpu") -> None:
    """The one-pass Triton layout copies (tile key ``cmp_copy=triton``) equal PyTorch's strided copies, bit for
    bit, both ways, with ``mul``, strided rows, whole sequences and chunks at an offset (the interpreter on
    CPU, ``tests/test_triton_kernels.py``'s job; the GPU in ``test_regroup_gpu``)."""
    from nsa.ops import tile_overrides

    gen = torch.Generator().manual_seed(4)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    B, HQ, H, D = 2, 6, 2, 24
    for S, l, d, q_start in [(48, 8, 4, 0), (43, 8, 4, 0), (7, 8, 4, 0), (21, 8, 4, 12), (3, 8, 4, 30),  # noqa: E741
                             (17, 8, 4, 7)]:
        x3 = torch.randn(B, S, HQ, 3, D, generator=gen).to(device, dtype)
        x = x3[:, :, :, 1]  # strided rows, as the op's o3 slots
        m = torch.rand(B, S, HQ, 3, generator=gen).to(device, dtype)[..., 2:]
        want = [cmp_sdpa.to_virtual(x, H, l, d, q_start=q_start), cmp_sdpa.to_virtual(x, H, l, d, m, q_start)]
        back_want = torch.full_like(x3, 5.0)
        cmp_sdpa.to_rows(want[1], back_want[:, :, :, 0], H, l, d, fill=-1.0, q_start=q_start)
        with tile_overrides({"cmp_copy": "triton"}):
            got = [cmp_sdpa.to_virtual(x, H, l, d, q_start=q_start), cmp_sdpa.to_virtual(x, H, l, d, m, q_start)]
            back = torch.full_like(x3, 5.0)
            cmp_sdpa.to_rows(got[1], back[:, :, :, 0], H, l, d, fill=-1.0, q_start=q_start)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and torch.equal(a, b), (S, l, d, q_start)
        assert torch.equal(back, back_want), (S, l, d, q_start)
        # the gate gradient in the same pass: dg[..., 0] = sum(x * o) per row, o the rows of a virtual tensor
        # (zeros where none holds the row); its other columns untouched
        o_v = torch.randn(want[0].shape, generator=gen).to(device, dtype)
        o_rows = torch.zeros_like(x)
        cmp_sdpa.to_rows(o_v, o_rows, H, l, d, q_start=q_start)
        ref = (x.double() * o_rows.double()).sum(-1)
        for tune in ({"cmp_copy": "torch"}, {"cmp_copy": "triton"}):
            dg = torch.full((B, S, HQ, 3), 7.0, device=device)
            with tile_overrides(tune):
                y = cmp_sdpa.to_virtual(x, H, l, d, m, q_start, dot=(o_v, dg))
            assert torch.equal(y, want[1]), (S, q_start, tune)
            assert torch.allclose(dg[..., 0].double(), ref, rtol=1e-5, atol=1e-5), (S, q_start, tune)
            assert (dg[..., 1:] == 7.0).all(), (S, q_start, tune)


@pytest.mark.gpu
def test_regroup_gpu() -> None:
    _regroup_case("cuda")
