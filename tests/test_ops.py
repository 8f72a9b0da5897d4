"""The spec's checks for every NSA backend (docs/nsa-semantics.md, last section), plus edge cases.

Every backend runs through the same parametrised tests (``backend`` fixture: reference, torch, and
triton where it can run). The reference is the float64 oracle.
"""

from __future__ import annotations

import pytest
import torch

import nsa.ops as ops
from nsa.ops import NSAParams
from nsa.ops import reference as ref
from nsa.ops.indexing import forced_blocks, num_cmp, num_visible_cmp
from tests.conftest import make_inputs


def _tol(backend: str) -> dict[str, float]:
    return {"atol": 1e-10, "rtol": 1e-9} if backend != "triton" else {"atol": 2e-2, "rtol": 2e-2}


def _dtype(backend: str) -> torch.dtype:
    return torch.float64 if backend != "triton" else torch.float32


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Naive float64 causal attention with GQA (head i reads group i // h)."""
    _B, S, HQ, Dk = q.shape
    H = k.shape[2]
    h = HQ // H
    scale = Dk**-0.5 if scale is None else scale
    kk = k.repeat_interleave(h, dim=2).transpose(1, 2)
    vv = v.repeat_interleave(h, dim=2).transpose(1, 2)
    s = (q.transpose(1, 2) @ kk.transpose(-1, -2)) * scale
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return (p @ vv).transpose(1, 2)


def run(backend: str, x, hp: NSAParams, *, gates=None, block_idx=None, **kw):
    args = list(x.args())
    if gates is not None:
        args[-1] = gates
    return ops.nsa_attention(*args, hp, block_idx=block_idx, backend=backend, **kw)


def one_hot_gates(x, branch: int) -> torch.Tensor:
    g = torch.zeros_like(x.gates)
    g[..., branch] = 1.0
    return g


# ---------------------------------------------------------------------------------------------------
# Equivalence with dense attention in the two degenerate configurations

@pytest.mark.parametrize("h", [1, 2, 6])
def test_window_covering_everything_is_dense(backend: str, h: int) -> None:
    x = make_inputs(2, 37, 2 * h, 2, 8, 6, l=8, d=4, dtype=_dtype(backend), device=_device(backend))
    out = run(backend, x, NSAParams(l=8, d=4, l_sel=8, n_sel=2, w=37), gates=one_hot_gates(x, 2))
    torch.testing.assert_close(out, dense_causal(x.q, x.k_win, x.v_win), **_tol(backend))


@pytest.mark.parametrize("h", [1, 2, 6])
def test_selection_covering_everything_is_dense(backend: str, h: int) -> None:
    x = make_inputs(2, 37, 2 * h, 2, 8, 6, l=8, d=4, dtype=_dtype(backend), device=_device(backend))
    out = run(backend, x, NSAParams(l=8, d=4, l_sel=8, n_sel=5, w=3), gates=one_hot_gates(x, 1))  # 5*8 >= 37
    torch.testing.assert_close(out, dense_causal(x.q, x.k_sel, x.v_sel), **_tol(backend))


# ---------------------------------------------------------------------------------------------------
# Causality: the future never changes the present (all branches, selection computed or given)

@pytest.mark.parametrize("given_blocks", [False, True])
def test_causality_probe(backend: str, given_blocks: bool) -> None:
    hp = NSAParams(l=8, d=4, l_sel=8, n_sel=3, w=6)
    S = 41
    for t in (5, 12, 23, 33):
        x = make_inputs(1, S, 4, 2, 8, 8, l=8, d=4, dtype=_dtype(backend), device=_device(backend))
        y = make_inputs(1, S, 4, 2, 8, 8, l=8, d=4, dtype=_dtype(backend), device=_device(backend))
        for name in ("q", "k_raw", "v_raw", "k_sel", "v_sel", "k_win", "v_win", "gates"):
            getattr(y, name)[:, : t + 1] = getattr(x, name)[:, : t + 1]  # same past, different future
        bx = by = None
        if given_blocks:
            bx = ref.select_blocks(x.q, x.k_cmp, NSAParams(l=8, d=4, l_sel=8, n_sel=3))
            by = ref.select_blocks(y.q, y.k_cmp, NSAParams(l=8, d=4, l_sel=8, n_sel=3))
            assert torch.equal(bx[:, : t + 1], by[:, : t + 1]), "selection depends on the future"
        ox, ix = run(backend, x, hp, block_idx=bx, return_block_idx=True)
        oy, iy = run(backend, y, hp, block_idx=by, return_block_idx=True)
        assert torch.equal(ix[:, : t + 1], iy[:, : t + 1])
        torch.testing.assert_close(ox[:, : t + 1], oy[:, : t + 1], **_tol(backend))
        assert not torch.allclose(ox[:, t + 1 :], oy[:, t + 1 :]), "probe changed nothing"


# ---------------------------------------------------------------------------------------------------
# Selection: group consistency, forced blocks, determinism and ties, padding

def test_selection_matches_reference_and_is_group_shared(backend: str) -> None:
    x = make_inputs(2, 70, 12, 2, 8, 8, l=8, d=4, dtype=_dtype(backend), device=_device(backend))
    idx = ops.select_blocks(x.q, x.k_cmp, NSAParams(l=8, d=4, l_sel=8, n_sel=4), backend=backend)
    assert idx.dtype == torch.int32 and idx.shape == (2, 70, 2, 4)
    if backend != "reference":  # the reference itself: only the group-sharing half below
        expect = ref.select_blocks(x.q.double().cpu(), x.k_cmp.double().cpu(), NSAParams(l=8, d=4, l_sel=8, n_sel=4))
        if backend == "triton":  # bf16/fp32 rounding may flip near-ties; almost all rows agree
            assert (idx.cpu() == expect).all(-1).float().mean() > 0.97
        else:
            assert torch.equal(idx.cpu(), expect)
    # permuting the query heads inside a group changes neither the group's blocks nor their union
    perm = torch.tensor([5, 3, 1, 0, 2, 4, 11, 6, 10, 7, 9, 8], device=x.q.device)
    idx_p = ops.select_blocks(x.q[:, :, perm], x.k_cmp, NSAParams(l=8, d=4, l_sel=8, n_sel=4), backend=backend)
    assert torch.equal(idx, idx_p)


def test_forced_blocks_and_padding(backend: str) -> None:
    l_sel, n_sel = 8, 4
    x = make_inputs(1, 60, 4, 2, 8, 8, l=8, d=4, dtype=_dtype(backend), device=_device(backend))
    idx = ops.select_blocks(x.q, x.k_cmp, NSAParams(l=8, d=4, l_sel=l_sel, n_sel=n_sel), backend=backend).cpu()
    for t in range(60):
        bt = t // l_sel
        want = min(n_sel, bt + 1)
        for g in range(2):
            row = idx[0, t, g].tolist()
            valid = [b for b in row if b >= 0]
            assert len(valid) == want and valid == sorted(valid) and len(set(valid)) == want
            assert row[want:] == [-1] * (n_sel - want)
            assert all(0 <= b <= bt for b in valid)
            for f in forced_blocks(t, l_sel)[:want]:
                assert f in valid


def test_ties_go_to_the_lower_block_and_are_deterministic(backend: str) -> None:
    # identical compressed keys -> every visible token gets the same probability -> fully covered
    # blocks tie exactly; the free slots must go to the lowest indices among them
    l, d, l_sel, n_sel, S = 8, 8, 8, 4, 64  # noqa: E741
    # small random integers keep every dot product exact, so the ties are exact in any summation order
    dev, dt = _device(backend), _dtype(backend)
    q = torch.randint(-3, 4, (1, S, 2, 8)).to(dev, dt)
    one = torch.randint(1, 4, (8,)).to(dev, dt)
    k_cmp = one.expand(1, num_cmp(S, l, d), 1, 8).contiguous()
    a = ops.select_blocks(q, k_cmp, NSAParams(l=l, d=d, l_sel=l_sel, n_sel=n_sel), backend=backend).cpu()
    b = ops.select_blocks(q, k_cmp, NSAParams(l=l, d=d, l_sel=l_sel, n_sel=n_sel), backend=backend).cpu()
    assert torch.equal(a, b)
    for t in range(S):
        bt = t // l_sel
        forced = forced_blocks(t, l_sel)[: min(n_sel, bt + 1)]
        n_vis = num_visible_cmp(t, l, d)
        # blocks b < n_vis are fully covered by visible tokens (equal P); later ones have P = 0
        free = [blk for blk in range(bt + 1) if blk not in forced]
        ranked = sorted(free, key=lambda blk: (0 if blk < n_vis else 1, blk))
        expect = sorted(forced + ranked[: min(n_sel, bt + 1) - len(forced)])
        assert [v for v in a[0, t, 0].tolist() if v >= 0] == expect, t


def test_given_block_idx_is_used_as_is(backend: str) -> None:
    x = make_inputs(1, 40, 4, 2, 8, 8, l=8, d=4, dtype=_dtype(backend), device=_device(backend))
    hp = NSAParams(l=8, d=4, l_sel=8, n_sel=2, w=4)
    # only the current block (plus padding): selection reads [b_t * l_sel, t]
    t = torch.arange(40)
    blocks = torch.full((1, 40, 2, 2), -1, dtype=torch.int32)
    blocks[..., 0] = (t // 8).to(torch.int32)[None, :, None]
    blocks = blocks.to(x.q.device)
    out = run(backend, x, hp, block_idx=blocks, gates=one_hot_gates(x, 1))
    expect = ref.nsa_attention(*[a.double().cpu() for a in x.args()[:-1]], one_hot_gates(x, 1).double().cpu(),
                               hp, block_idx=blocks.cpu())
    torch.testing.assert_close(out.double().cpu(), expect, **_tol(backend))


# ---------------------------------------------------------------------------------------------------
# Compressed branch: visible tokens only, zero rows without NaN

def test_compressed_branch_rows_without_tokens_are_zero(backend: str) -> None:
    l, d = 8, 4  # noqa: E741
    x = make_inputs(2, 30, 4, 2, 8, 6, l=l, d=d, dtype=_dtype(backend), device=_device(backend))
    for name in ("q", "k_raw", "v_raw"):
        getattr(x, name).requires_grad_(True)
    out = run(backend, x, NSAParams(l=l, d=d, l_sel=8, n_sel=2, w=4), gates=one_hot_gates(x, 0))
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, : l - 1], torch.zeros_like(out[:, : l - 1]))
    assert out[:, l - 1 :].abs().amax(-1).min() > 0
    out.sum().backward()
    for name in ("q", "k_raw", "v_raw"):
        assert torch.isfinite(getattr(x, name).grad).all()


def test_compressed_branch_normalises_over_visible_tokens_only(backend: str) -> None:
    l, d, S = 8, 4, 33  # noqa: E741
    x = make_inputs(1, S, 2, 1, 8, 8, l=l, d=d, dtype=_dtype(backend), device=_device(backend))
    out = run(backend, x, NSAParams(l=l, d=d, l_sel=8, n_sel=2, w=4), gates=one_hot_gates(x, 0))
    kc, vc = x.k_cmp, x.v_cmp
    for t in (7, 12, 20, 32):
        n = num_visible_cmp(t, l, d)
        p = torch.softmax(x.q[0, t] @ kc[0, :n, 0].T * 8**-0.5, dim=-1)
        torch.testing.assert_close(out[0, t], p @ vc[0, :n, 0], **_tol(backend))


# ---------------------------------------------------------------------------------------------------
# Edge cases and agreement with the reference

EDGE_CASES = [
    # B, S, HQ, H, Dk, Dv, l, d, l_sel, n_sel, w
    (1, 5, 2, 1, 8, 8, 8, 4, 8, 2, 4),  # S < l
    (1, 6, 4, 2, 8, 8, 4, 2, 8, 2, 3),  # S < l_sel
    (2, 1, 2, 2, 8, 8, 4, 2, 4, 2, 2),  # S = 1
    (1, 29, 6, 3, 8, 8, 4, 4, 4, 16, 5),  # n_sel > candidates
    (1, 30, 16, 1, 8, 8, 8, 4, 8, 3, 7),  # h = 16
    (2, 34, 6, 1, 12, 4, 8, 4, 16, 2, 9),  # h = 6, Dk != Dv, batch 2, l_sel > l
    (1, 31, 2, 2, 8, 8, 6, 3, 3, 3, 8),  # l_sel = d < l
]


@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: "B{}S{}HQ{}H{}Dk{}Dv{}-l{}d{}ls{}n{}w{}".format(*c))
def test_agrees_with_reference(fast_backend: str, case: tuple[int, ...]) -> None:
    backend = fast_backend
    B, S, HQ, H, Dk, Dv, l, d, l_sel, n_sel, w = case  # noqa: E741
    x = make_inputs(B, S, HQ, H, Dk, Dv, l=l, d=d, dtype=_dtype(backend), device=_device(backend))
    out, idx = run(backend, x, NSAParams(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w), return_block_idx=True)
    assert out.shape == (B, S, HQ, Dv) and torch.isfinite(out).all()
    cpu64 = [a.double().cpu() for a in x.args()]
    expect = ref.nsa_attention(*cpu64, NSAParams(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w), block_idx=idx.cpu())
    torch.testing.assert_close(out.double().cpu(), expect, **_tol(backend))
    ref_idx = ref.select_blocks(cpu64[0], cpu64[1], NSAParams(l=l, d=d, l_sel=l_sel, n_sel=n_sel))
    if backend != "triton":
        assert torch.equal(idx.cpu(), ref_idx)


def test_compress_avg_matches_definition(backend: str) -> None:
    x = torch.randn(2, 45, 3, 5, dtype=_dtype(backend), device=_device(backend))
    out = ops.compress_avg(x, NSAParams(l=8, d=4), backend=backend)
    assert out.shape == (2, num_cmp(45, 8, 4), 3, 5)
    for j in range(out.shape[1]):
        torch.testing.assert_close(out[:, j], x[:, 4 * j : 4 * j + 8].mean(1))
    assert ops.compress_avg(x[:, :7], NSAParams(l=8, d=4), backend=backend).shape == (2, 0, 3, 5)


# ---------------------------------------------------------------------------------------------------
# Gradients

GRAD_NAMES = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")


@pytest.mark.parametrize("backend_name", ["reference", "torch"])
def test_gradcheck_float64(backend_name: str) -> None:
    hp = NSAParams(l=4, d=2, l_sel=4, n_sel=2, w=3)
    x = make_inputs(1, 11, 2, 1, 4, 3, l=4, d=2)
    args = [a.detach().clone().requires_grad_(True) for a in x.args()]
    blocks = ref.select_blocks(args[0].detach(), args[1].detach(), NSAParams(l=4, d=2, l_sel=4, n_sel=2))

    def f(*a: torch.Tensor) -> torch.Tensor:
        return ops.nsa_attention(*a, hp, block_idx=blocks, backend=backend_name)

    assert torch.autograd.gradcheck(f, tuple(args), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradients_match_reference(fast_backend: str) -> None:
    backend = fast_backend
    hp = NSAParams(l=8, d=4, l_sel=8, n_sel=3, w=6)
    x = make_inputs(2, 37, 6, 2, 8, 6, l=8, d=4, dtype=_dtype(backend), device=_device(backend))
    grads = {}
    for name in ("reference", backend):
        args = [a.detach().clone().double().cpu() if name == "reference" else a.detach().clone() for a in x.args()]
        for a in args:
            a.requires_grad_(True)
        out = ops.nsa_attention(*args, hp, backend=name)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        (out * upstream.to(out.device, out.dtype)).sum().backward()
        grads[name] = [a.grad.double().cpu() for a in args]
    for nm, g_ref, g in zip(GRAD_NAMES, grads["reference"], grads[backend], strict=True):
        assert torch.isfinite(g).all(), nm
        assert g.abs().max() > 0, nm
        torch.testing.assert_close(g, g_ref, **_tol(backend), msg=lambda m, nm=nm: f"grad {nm}: {m}")


def test_window_query_is_the_window_branchs_own(backend: str) -> None:
    """``q_win``: the window branch attends with its own queries; the compressed and selected branches and
    the block choice keep ``q`` (the output is the sum of the op with the window gated off and the op run
    with ``q_win`` as the query and only the window gated on); ``q_win=q`` is the one-query op exactly,
    and every gradient, ``q_win``'s included, equals the reference's."""
    hp = NSAParams(l=8, d=4, l_sel=8, n_sel=3, w=6)
    x = make_inputs(2, 37, 6, 2, 8, 6, l=8, d=4, dtype=_dtype(backend), device=_device(backend), seed=21)
    qw = make_inputs(2, 37, 6, 2, 8, 6, l=8, d=4, dtype=_dtype(backend), device=_device(backend), seed=22).q
    a = list(x.args())
    out, idx = ops.nsa_attention(*a, hp, q_win=qw, return_block_idx=True, backend=backend)
    only = torch.zeros_like(a[7])
    cs, win = a[7] * torch.tensor([1.0, 1.0, 0.0], dtype=a[7].dtype, device=a[7].device), only.clone()
    win[..., 2] = a[7][..., 2]
    expect = (ops.nsa_attention(*a[:7], cs, hp, backend=backend)
              + ops.nsa_attention(qw, *a[1:7], win, hp, block_idx=idx, backend=backend))
    torch.testing.assert_close(out, expect, **_tol(backend))
    assert torch.equal(idx, ops.select_blocks(a[0], a[1], hp, backend=backend))
    same = ops.nsa_attention(*a, hp, q_win=a[0], backend=backend)
    torch.testing.assert_close(same, ops.nsa_attention(*a, hp, backend=backend), rtol=0, atol=0)
    if backend == "reference":
        return
    grads = {}
    for name in ("reference", backend):
        args = [t.detach().clone().double().cpu() if name == "reference" else t.detach().clone() for t in (*a, qw)]
        for t in args:
            t.requires_grad_(True)
        o = ops.nsa_attention(*args[:8], hp, q_win=args[8], backend=name)
        up = torch.randn(o.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
        (o * up.to(o.device, o.dtype)).sum().backward()
        grads[name] = [t.grad.double().cpu() for t in args]
    for nm, g_ref, g in zip((*GRAD_NAMES, "q_win"), grads["reference"], grads[backend], strict=True):
        torch.testing.assert_close(g, g_ref, **_tol(backend), msg=lambda m, nm=nm: f"grad {nm}: {m}")
    with pytest.raises(ValueError, match="q_win"):
        ops.nsa_attention(*a, hp, q_win=qw[:, :5], backend=backend)


def test_no_gradient_through_block_choice() -> None:
    """Choosing blocks is not differentiated (spec): q's and k_cmp's gradients with the blocks chosen inside
    the op equal those with the same blocks passed in as constants; with the compressed branch gated off,
    k_cmp gets no gradient at all. (A soft or leaking top-n would add a score gradient to both.)"""
    x = make_inputs(1, 24, 2, 1, 4, 4, l=4, d=2)
    hp = NSAParams(l=4, d=2, l_sel=4, n_sel=2, w=3)
    gates = x.gates.detach().clone()
    gates[..., 0] = 0.0  # compressed branch off: only the selection could carry gradient into k_cmp
    up = torch.randn(1, 24, 2, 4, generator=torch.Generator().manual_seed(3), dtype=x.q.dtype)
    idx = ops.select_blocks(x.q.detach(), x.k_cmp.detach(), NSAParams(l=4, d=2, l_sel=4, n_sel=2))
    grads = []
    for block_idx in (None, idx):
        args = [a.detach().clone().requires_grad_(True) for a in x.args()]
        args[-1] = gates.clone().requires_grad_(True)
        out = ops.nsa_attention(*args, hp, block_idx=block_idx, backend="torch")
        (out * up).sum().backward()
        grads.append([a.grad for a in args])
    (gq_inside, gkc_inside, *_), (gq_given, *_) = grads
    assert gkc_inside is None or torch.count_nonzero(gkc_inside) == 0
    assert gq_inside is not None and gq_given is not None and gq_inside.abs().max() > 0
    torch.testing.assert_close(gq_inside, gq_given, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# Validation and dispatch

@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(l=32, d=24), "nsa.d=24 must divide nsa.l=32"),
        (dict(l=32, d=16, l_sel=40), "nsa.d=16 must divide nsa.l_sel=40"),
        (dict(n_sel=0), "nsa.n_sel=0 must be positive"),
        (dict(w=0), "nsa.w=0 must be positive"),
    ],
)
def test_invalid_hyperparameters_name_the_field(bad: dict, message: str) -> None:
    """The one object every path takes refuses bad values on construction, naming the field."""
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        NSAParams(**(dict(l=8, d=4, l_sel=8, n_sel=2, w=4) | bad))


def test_dispatch_default_context_and_fallback_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    x = make_inputs(1, 20, 2, 1, 8, 8, l=4, d=2, dtype=torch.float32)
    hp = NSAParams(l=4, d=2, l_sel=4, n_sel=2, w=3)
    monkeypatch.setenv("NSA_ATTN_BACKEND", "reference")  # a run setting: the ops never read it
    assert ops.requested_backend() == "auto"
    ops.set_default_backend("reference")
    try:
        assert ops.requested_backend() == "reference"
        with ops.use_backend("torch"):
            assert ops.requested_backend() == "torch"
        assert ops.requested_backend("triton") == "triton"
        with pytest.raises(ValueError, match="unknown NSA backend"):
            ops.set_default_backend("cuda-magic")
    finally:
        ops.set_default_backend(None)
    assert ops.requested_backend() == "auto"
    ops.reset_fallback_counts()
    if not torch.cuda.is_available():
        out = ops.nsa_attention(*x.args(), hp, backend="triton")  # cannot serve CPU tensors here
        torch.testing.assert_close(out, ops.nsa_attention(*x.args(), hp, backend="torch"))
        counts = ops.fallback_counts()
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            assert sum(counts.values()) == 1 and next(iter(counts)).startswith("nsa_attention:triton->torch")
    with pytest.raises(ValueError, match="unknown NSA backend"):
        ops.nsa_attention(*x.args(), hp, backend="magic")
    assert "reference" in ops.available_backends("cpu") and "torch" in ops.available_backends("cpu")


@pytest.mark.gpu
def test_triton_backend_under_torch_compile_matches_eager() -> None:
    x = make_inputs(2, 300, 12, 2, 64, 64, l=32, d=16, dtype=torch.bfloat16, device="cuda")
    hp = NSAParams(l=32, d=16, l_sel=64, n_sel=4, w=64)

    def f(*a: torch.Tensor) -> torch.Tensor:
        return ops.nsa_attention(*a, hp, backend="triton")

    results = []
    for fn in (f, torch.compile(f)):
        args = [a.detach().clone().requires_grad_(True) for a in x.args()]
        out = fn(*args)
        out.float().square().sum().backward()
        results.append([out.float()] + [a.grad.float() for a in args])
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, atol=3e-2, rtol=3e-2)


def test_tile_overrides_are_scoped_and_checked() -> None:
    """Block-shape overrides hold inside their block only (nested blocks merge), in every thread; unknown keys are
    refused."""
    from nsa.ops import tile_overrides
    from nsa.ops._triton import tuned

    assert tuned("sel_bm", 64) == 64
    with tile_overrides({"sel_bm": 16}):
        assert tuned("sel_bm", 64) == 16
        with tile_overrides({"dec_waves": 3}):
            assert (tuned("sel_bm", 64), tuned("dec_waves", 2)) == (16, 3)
        assert tuned("dec_waves", 2) == 2
    assert tuned("sel_bm", 64) == 64
    with pytest.raises(ValueError, match="unknown tile override sel_bmx"), tile_overrides({"sel_bmx": 1}):
        pass
    # every thread sees them: autograd runs the backward of CUDA tensors in a thread of its own
    import threading

    seen: list[int | str] = []
    with tile_overrides({"sel_mode": "row"}):
        t = threading.Thread(target=lambda: seen.append(tuned("sel_mode", "fsa")))
        t.start()
        t.join()
    assert seen == ["row"] and tuned("sel_mode", "fsa") == "fsa"


def test_starting_the_toolkit_does_not_import_dynamo() -> None:
    """Dynamo costs 7-8 s of every process's start (launchers, ranks, CLI calls), compiled or not: importing
    the CLI, the trainer and the model must not load it; the ops mark their compile-time constants as Dynamo's
    own ``assume_constant_result`` does, so a compiled graph still folds them."""
    import subprocess
    import sys

    code = ("import sys, nsa_cli.app, nsa.train.trainer, nsa.model, nsa.ops; "
            "print('torch._dynamo' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stdout + res.stderr[-2000:]

    import torch._dynamo

    from nsa.ops._triton import _cc_major, _constant_under_compile, _sm_count

    def theirs() -> int:
        return 1

    def ours() -> int:
        return 1

    torch._dynamo.assume_constant_result(theirs)
    assert vars(_constant_under_compile(ours)) == vars(theirs) == {"_dynamo_marked_constant": True}
    assert vars(_sm_count) == vars(_cc_major) == vars(theirs)
