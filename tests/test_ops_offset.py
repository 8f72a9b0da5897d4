"""Queries at an offset (``q_start``, issue 32: context parallelism): ``S_q`` query rows at positions
``q_start .. q_start + S_q - 1`` against the keys of positions ``0 .. S_k - 1``.

- Reference (float64): the offset call's rows, block indices and gradients equal the whole sequence's
  (rows before ``q_start`` weighted 0 in the loss).
- Torch path: against the reference (same offsets), and a sequence split over "ranks" whose key gradients
  add up to the whole call's.
- Triton: under ``TRITON_INTERPRET=1`` on tiny shapes (one subprocess: both loop orders of the selected
  branch, split compressed dk/dv, score slabs, given block lists, ``S_k < l``, the custom ops' opcheck
  and an ``aot_eager`` compile); on a GPU (``-m gpu``) at S_k=8192, q_start=4096 in bf16 against the
  torch path.

Seeds are fixed and visible (the ``seed`` parameters); ``q_start`` values include 0, non-multiples of
``l``, ``d``, ``l_sel`` and the tile sizes, ``S_q = 1`` and ``S_k > q_start + S_q``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import nsa.ops as ops
from nsa.ops import NSAParams
from nsa.ops.indexing import num_cmp
from tests.conftest import Inputs, Job, make_inputs, run_job

HAS_CUDA = torch.cuda.is_available()
NAMES = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")
HP = NSAParams(l=8, d=4, l_sel=8, n_sel=3, w=6)
HP2 = NSAParams(l=16, d=8, l_sel=16, n_sel=2, w=12)
S = 37
# (q_start, S_q, S_k): full, ragged offsets (not multiples of l, d, l_sel or the 16-row tiles), one row,
# keys past the last query, an offset call whose keys end before S
OFFSETS = [(0, S, S), (13, 24, S), (21, 1, 22), (0, 1, 5), (0, 9, 30), (9, 20, S), (30, 7, S)]


def _cuts(q0: int, sq: int, sk: int, l: int, d: int) -> list[slice]:  # noqa: E741
    """Rows of the whole sequence's tensors (``NAMES`` order) that the call for query rows ``q0 .. q0+sq-1``
    against keys ``0 .. sk-1`` takes: its query rows, the keys ``< sk`` and their compressed tokens."""
    n_c = num_cmp(sk, l, d)
    return [slice(q0, q0 + sq), slice(0, n_c), slice(0, n_c)] + [slice(0, sk)] * 4 + [slice(q0, q0 + sq)]


def _call_args(x: Inputs, q0: int, sq: int, sk: int, dtype: torch.dtype | None = None,
               device: str | None = None) -> list[torch.Tensor]:
    """Fresh leaf inputs of the call for query rows ``q0 .. q0+sq-1`` against keys ``0 .. sk-1``."""
    cuts = _cuts(q0, sq, sk, x.l, x.d)
    return [a[:, c].detach().to(device or a.device, dtype or a.dtype).clone().requires_grad_(True)
            for a, c in zip(x.args(), cuts, strict=True)]


def _leaves(x: Inputs, dtype: torch.dtype = torch.float64, device: str = "cpu") -> list[torch.Tensor]:
    return [a.detach().to(device, dtype).clone().requires_grad_(True) for a in x.args()]


def _grads(out: torch.Tensor, args: list[torch.Tensor], w: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of ``sum(out * w)`` w.r.t. every input (zeros where none flows)."""
    gs = torch.autograd.grad(out, args, grad_outputs=w, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(a) if g is None else g for a, g in zip(args, gs, strict=True)]


def _expected_grads(full: list[torch.Tensor], q0: int, sq: int, sk: int, l: int, d: int) -> list[torch.Tensor]:  # noqa: E741
    """The whole call's gradients cut to the offset call's shapes (query rows; keys ``< sk``)."""
    return [g[:, c] for g, c in zip(full, _cuts(q0, sq, sk, l, d), strict=True)]


# ---------------------------------------------------------------------------------------------------
# The reference: the offset call is the whole sequence's rows, exactly

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("hp", [HP, HP2], ids=["l8-d4-ls8", "l16-d8-ls16"])
def test_reference_offset_equals_whole_sequence(seed: int, hp: NSAParams) -> None:
    x = make_inputs(1, S, 4, 2, 8, 6, l=hp.l, d=hp.d, seed=seed)
    full_args = _leaves(x)
    full, full_idx = ops.nsa_attention(*full_args, hp, backend="reference", return_block_idx=True)
    gen = torch.Generator().manual_seed(100 + seed)
    for q0, sq, sk in OFFSETS:
        args = _call_args(x, q0, sq, sk)
        out, idx = ops.nsa_attention(*args, hp, backend="reference", return_block_idx=True, q_start=q0)
        assert out.shape == (1, sq, 4, 6) and idx.shape == (1, sq, 2, hp.n_sel)
        assert torch.equal(out, full[:, q0:q0 + sq]), (q0, sq, sk)
        assert torch.equal(idx, full_idx[:, q0:q0 + sq]), (q0, sq, sk)
        assert torch.equal(ops.select_blocks(args[0], args[1], hp, backend="reference", q_start=q0), idx)
        w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        w_full = torch.zeros_like(full)
        w_full[:, q0:q0 + sq] = w  # rows before (and after) the call's rows get no loss weight
        want = _expected_grads(_grads(full, full_args, w_full), q0, sq, sk, hp.l, hp.d)
        got = _grads(out, args, w)
        for name, g, e in zip(NAMES, got, want, strict=True):
            torch.testing.assert_close(g, e, atol=1e-12, rtol=1e-10, msg=lambda m, n=name, c=(q0, sq, sk): f"{n} {c}: {m}")
        # every key row past the last query's reach gets exactly zero
        assert got[3][:, q0 + sq:].abs().sum() == 0 and got[5][:, q0 + sq:].abs().sum() == 0


# ---------------------------------------------------------------------------------------------------
# The torch path against the reference, and a split over ranks

@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("h", [1, 3])
def test_torch_path_offset_matches_reference(seed: int, h: int) -> None:
    x = make_inputs(2, S, 2 * h, 2, 8, 6, l=HP.l, d=HP.d, seed=seed)
    gen = torch.Generator().manual_seed(200 + seed)
    for q0, sq, sk in OFFSETS:
        outs, grads = {}, {}
        for backend in ("reference", "torch"):
            args = _call_args(x, q0, sq, sk)
            outs[backend] = ops.nsa_attention(*args, HP, backend=backend, return_block_idx=True, q_start=q0)
            if backend == "reference":
                w = torch.randn(outs[backend][0].shape, generator=gen, dtype=torch.float64)
            grads[backend] = _grads(outs[backend][0], args, w)
        (o_ref, i_ref), (o, i) = outs["reference"], outs["torch"]
        assert torch.equal(i, i_ref), (q0, sq, sk)
        torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-10)
        for name, g, e in zip(NAMES, grads["torch"], grads["reference"], strict=True):
            torch.testing.assert_close(g, e, atol=1e-12, rtol=1e-10, msg=lambda m, n=name, c=(q0, sq, sk): f"{n} {c}: {m}")


def _split_check(backend: str, x: Inputs, hp: NSAParams, bounds: list[int], dtype: torch.dtype, device: str,
                 tol: float) -> None:
    """Context parallelism in one process: rank ``r`` computes rows ``bounds[r] .. bounds[r+1]-1`` against
    the keys up to its last row; the rows concatenate to the whole call and the gradients add up to it."""
    full_args = _leaves(x, dtype, device)
    full, full_idx = ops.nsa_attention(*full_args, hp, backend=backend, return_block_idx=True)
    w = torch.randn(full.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(device, dtype)
    want = _grads(full, full_args, w)
    rows, total = [], [torch.zeros_like(g) for g in want]
    for q0, end in itertools.pairwise(bounds):
        args = _call_args(x, q0, end - q0, end, dtype, device)
        out = ops.nsa_attention(*args, hp, backend=backend, q_start=q0, block_idx=full_idx[:, q0:end])
        rows.append(out)
        for tot, g, cut in zip(total, _grads(out, args, w[:, q0:end]), _cuts(q0, end - q0, end, hp.l, hp.d),
                               strict=True):
            tot[:, cut] += g
    torch.testing.assert_close(torch.cat(rows, 1), full, atol=tol, rtol=tol)
    for name, g, e in zip(NAMES, total, want, strict=True):
        if dtype == torch.float64:
            torch.testing.assert_close(g, e, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert _rel(g, e) < tol, (name, _rel(g, e))


@pytest.mark.parametrize("bounds", [[0, 37], [0, 19, 37], [0, 5, 22, 23, 37]], ids=["1", "2", "4-ragged"])
def test_torch_path_split_over_ranks_adds_up(bounds: list[int]) -> None:
    x = make_inputs(1, S, 4, 2, 8, 8, l=HP.l, d=HP.d, seed=5)
    _split_check("torch", x, HP, bounds, torch.float64, "cpu", 1e-12)


# ---------------------------------------------------------------------------------------------------
# Bad input: one clear error

@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_q_start_out_of_range_is_refused(backend: str) -> None:
    x = make_inputs(1, 20, 2, 1, 8, 8, l=HP.l, d=HP.d, seed=6)
    args = _call_args(x, 10, 10, 20)
    with pytest.raises(ValueError, match="q_start"):
        ops.nsa_attention(*args, HP, backend=backend, q_start=11)  # rows would reach position 20 of 20 keys
    with pytest.raises(ValueError, match="q_start"):
        ops.nsa_attention(*args, HP, backend=backend, q_start=-1)


def test_too_few_compressed_tokens_are_refused() -> None:
    x = make_inputs(1, 20, 2, 1, 8, 8, l=HP.l, d=HP.d, seed=8)
    args = _call_args(x, 10, 10, 20)
    args[1] = args[1][:, :3]  # the query at position 19 sees 4 tokens
    with pytest.raises(ValueError, match="k_cmp holds 3 compressed tokens but the query at position 19 sees 4"):
        ops.select_blocks(args[0], args[1], HP, backend="torch", q_start=10)
    with pytest.raises(ValueError, match="k_cmp holds 3"):
        ops.nsa_attention(*args, HP, backend="torch", q_start=10)


def test_q_start_with_cu_seqlens_is_refused() -> None:
    x = make_inputs(1, 20, 2, 1, 8, 8, l=HP.l, d=HP.d, seed=7)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="q_start=4 cannot be combined with cu_seqlens"):
        ops.nsa_attention(*x.args(), HP, cu_seqlens=cu, q_start=4)
    with pytest.raises(ValueError, match="q_start=4 cannot be combined with cu_seqlens"):
        ops.select_blocks(x.q, x.k_cmp, HP, cu_seqlens=cu, q_start=4)
    ops.nsa_attention(*x.args(), HP, cu_seqlens=cu, q_start=0)  # the default still serves packed rows


# ---------------------------------------------------------------------------------------------------
# Triton, in the interpreter (CPU) and on a GPU

INTERP_CASES = {
    # id: ((B, S_k, HQ, H, Dk, Dv, l, d, l_sel, n_sel, w), [(q_start, S_q), ...], tile overrides, seed)
    "h2-fsa-DkneDv": ((2, 30, 4, 2, 16, 32, 8, 4, 8, 3, 10), [(13, 17), (21, 1), (0, 15)], {}, 10),
    "h2-row-tma": ((1, 34, 4, 2, 16, 16, 8, 4, 8, 3, 10), [(11, 21), (33, 1)], {"sel_mode": "row", "sel_tma": 1}, 11),
    "h6-split-dkdv-slabs": ((1, 36, 6, 1, 16, 16, 8, 4, 16, 3, 16), [(5, 29)], {"cmp_qch": 8, "score_slab": 7}, 12),
    "h1-S-lt-l": ((1, 12, 2, 2, 16, 16, 16, 8, 16, 2, 4), [(3, 9), (0, 5)], {}, 13),
    # context-parallel chunks (keys end with them) with the compressed branch on the virtual rows, split into
    # a rectangle and a causal square where the chunk starts past the first virtual row (plain torch on CPU)
    "h2-cmp-sdpa-chunks": ((1, 40, 4, 2, 16, 16, 8, 4, 8, 3, 10), [(21, 19), (12, 28), (5, 35), (39, 1)], {}, 16,
                           "cpu", "math"),
    # ... with the layout copies in Triton, and the compressed output kept only in its virtual layout (its
    # gate's gradient formed in the copy of do)
    "h2-cmp-sdpa-chunks-triton-copies": ((1, 40, 4, 2, 16, 16, 8, 4, 8, 3, 10), [(21, 19), (5, 35)],
                                         {"cmp_copy": "triton", "o3_slots": 2}, 17, "cpu", "math"),
}


def _triton_offset_case(dims: tuple[int, ...], offsets: list[tuple[int, int]], tune: dict, seed: int,
                        device: str = "cpu", cmp_path: str | None = None) -> None:
    """Triton with ``q_start`` against the float64 reference: block indices (computed, and ``select_blocks``),
    output and all eight gradients; keys past the last query (``S_k > q_start + S_q``) included. ``cmp_path``:
    the compressed branch's path where it can serve (chunks whose keys end with them)."""
    import contextlib

    from nsa.ops import reference, tile_overrides, triton_path

    B, Sk, HQ, H, Dk, Dv, l, d, l_sel, n_sel, w = dims  # noqa: E741
    hp = NSAParams(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = make_inputs(B, Sk, HQ, H, Dk, Dv, l=l, d=d, dtype=dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    ran = triton_path.path_counts().get(cmp_path or "", 0)
    with tile_overrides(tune), contextlib.ExitStack() as stack:
        if cmp_path is not None:
            triton_path.set_cmp_path(cmp_path)
            stack.callback(triton_path.set_cmp_path, None)
            # every chunk here ends with the keys: each one's compressed branch took that path
            stack.callback(lambda: _assert(triton_path.path_counts().get(cmp_path, 0) == ran + len(offsets)))
        for q0, sq in offsets:
            args = _call_args(x, q0, sq, Sk)
            ref_args = [a.detach().double().cpu().requires_grad_(True) for a in args]
            out, idx = triton_path.nsa_attention(*args, hp, return_block_idx=True, q_start=q0)
            ref, ref_idx = reference.nsa_attention(*ref_args, hp, return_block_idx=True, q_start=q0)
            assert torch.equal(idx.cpu(), ref_idx), (q0, sq)
            if sq == 1:  # the op alone (the same kernels as inside nsa_attention): one cheap row
                assert torch.equal(triton_path.select_blocks(args[0], args[1], hp, q_start=q0).cpu(), ref_idx)
            grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
            out.backward(grad.to(device, dtype))
            ref.backward(grad)
            assert _rel(out, ref) < 2e-5, (q0, sq)
            for name, a, r in zip(NAMES, args, ref_args, strict=True):
                if r.grad is None:  # k_cmp / v_cmp without a compressed token (S_k < l)
                    assert a.grad is None or a.grad.abs().sum() == 0, name
                    continue
                assert a.grad is not None and a.grad.shape == a.shape, name
                assert _rel(a.grad, r.grad) < 2e-5, (q0, sq, name, _rel(a.grad, r.grad))


def _assert(ok: bool) -> None:
    assert ok


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values (unwritten output?)"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _triton_given_blocks_case(device: str = "cpu") -> None:
    """A given block list with duplicates, ``-1`` anywhere and blocks past each row's own (absolute block
    numbers, rows at an offset): the same keys as the reference reads, both loop orders."""
    from nsa.ops import reference, tile_overrides, triton_path

    hp = NSAParams(l=8, d=4, l_sel=8, n_sel=5, w=6)
    q0, sq, sk = 11, 14, 30
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = make_inputs(1, sk, 4, 2, 16, 16, l=8, d=4, dtype=dtype, device=device, seed=14)
    gen = torch.Generator().manual_seed(14)
    idx = torch.randint(-1, sk // 8 + 1, (1, sq, 2, 5), generator=gen, dtype=torch.int32)
    idx[..., 1] = idx[..., 0]
    ref_args = [a.detach().double().cpu().requires_grad_(True) for a in _call_args(x, q0, sq, sk)]
    ref = reference.nsa_attention(*ref_args, hp, block_idx=idx, q_start=q0)
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref.backward(grad)
    for mode in ("row", "fsa"):
        args = _call_args(x, q0, sq, sk)
        with tile_overrides({"sel_mode": mode}):
            out = triton_path.nsa_attention(*args, hp, block_idx=idx.to(device), q_start=q0)
            out.backward(grad.to(device, dtype))
        tol = 2e-5 if device == "cpu" else 2e-2
        assert _rel(out, ref) < tol, mode
        for name, a, r in zip(NAMES, args, ref_args, strict=True):
            assert a.grad is not None and _rel(a.grad, r.grad) < tol, (mode, name)


def _triton_custom_ops_case() -> None:
    """The custom operators with ``q_start``: opcheck of the forward (fake tensors, autograd registration;
    the ``fsa`` order, whose pair list's fake shape depends on ``q_start``; the backward's fake is the
    inputs' shapes), the dispatcher serving the call without a fallback, and an ``aot_eager`` compile
    (fake implementations traced, one graph) equal to eager, gradients included."""
    x = make_inputs(1, 24, 4, 2, 16, 16, l=8, d=4, dtype=torch.float32, seed=15)
    q0 = 7
    args = _call_args(x, q0, 24 - q0, 24)
    fwd_args = (*args, None, 8, 4, 8, 2, 16, 0.25, q0)
    torch.library.opcheck(torch.ops.nsa.attention_fwd.default, fwd_args,
                          test_utils=("test_faketensor", "test_autograd_registration"))
    outs = torch.ops.nsa.attention_fwd.default(*fwd_args)
    assert outs[0].shape == (1, 24 - q0, 4, 16) and outs[6].numel() > 0  # the fsa pair list
    hp = NSAParams(l=8, d=4, l_sel=8, n_sel=2, w=16)
    ops.reset_fallback_counts()

    def f(*a: torch.Tensor) -> torch.Tensor:
        return ops.nsa_attention(*a, hp, backend="triton", q_start=q0)

    eager = f(*args)
    assert ops.fallback_counts() == {}
    (eager * eager).sum().backward()
    g_eager = [a.grad for a in args]
    args2 = [a.detach().clone().requires_grad_(True) for a in args]
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(*args2)
    (compiled * compiled).sum().backward()
    assert torch.equal(compiled, eager)
    for name, a, g in zip(NAMES, args2, g_eager, strict=True):
        assert a.grad is not None and torch.equal(a.grad, g), name


def _o3_slots_saved_case() -> None:
    """Tile key ``o3_slots=2`` keeps one branch output fewer between forward and backward: where the compressed
    branch runs through the library's autograd node (cuDNN/FlashAttention, and here the math kernels of a chunk
    at an offset), which saves its output itself, exactly one ``[B, S_q, HQ, Dv]`` buffer less of what the op
    saves (``nsa.bench.attention.saved_mib``), and the same output."""
    from nsa.bench.attention import saved_mib
    from nsa.ops import tile_overrides, triton_path

    hp = NSAParams(l=8, d=4, l_sel=8, n_sel=3, w=10)
    x = make_inputs(2, 40, 4, 2, 16, 16, l=8, d=4, dtype=torch.float32, seed=18)
    args = _call_args(x, 21, 19, 40)
    triton_path.set_cmp_path("math")
    try:
        got = {}
        for slots in (3, 2):
            with tile_overrides({"o3_slots": slots}):
                got[slots] = (saved_mib(lambda: triton_path.nsa_attention(*args, hp, q_start=21), args),
                              triton_path.nsa_attention(*args, hp, q_start=21).detach())
    finally:
        triton_path.set_cmp_path(None)
    assert got[3][0] - got[2][0] == pytest.approx(2 * 19 * 4 * 16 * 4 / 2**20), got
    assert torch.equal(got[3][1], got[2][1])


def _stages_repeat_case() -> None:
    """The stage methods called again and again, as ``nsa bench attention --stages`` and
    ``scripts/kernel_sweep.py`` time them: the same output each time, with the compressed branch given and its
    output in ``o3`` or only in the virtual layout (``o3_slots``)."""
    from nsa.ops import cmp_sdpa, tile_overrides
    from nsa.ops.triton_path import Stages

    hp = NSAParams(l=8, d=4, l_sel=8, n_sel=3, w=10)
    x = make_inputs(1, 40, 4, 2, 16, 16, l=8, d=4, dtype=torch.float32, seed=19)
    q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates = (a.detach() for a in x.args())
    for slots in (3, 2):
        with tile_overrides({"o3_slots": slots}):
            st = Stages(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, hp, 16**-0.5)
            st.forward(None, cmp_sdpa.attend(q, k_cmp, v_cmp, hp.l, hp.d, 16**-0.5, "math"))
            first = st.out.clone()
            st.win_fwd()
            st.win_fwd()
            assert st.o3.shape[3] == slots and torch.equal(st.out, first), slots


def _interpreter_job() -> Job:
    calls = "".join(f"print({name!r}, flush=True); _triton_offset_case(*{case!r})\n"
                    for name, case in INTERP_CASES.items())
    calls += "print('given blocks', flush=True); _triton_given_blocks_case()\n"
    calls += "print('custom ops', flush=True); _triton_custom_ops_case()\n"
    calls += "print('o3 slots saved', flush=True); _o3_slots_saved_case()\n"
    calls += "print('stages again', flush=True); _stages_repeat_case()\n"
    return Job("from tests.test_ops_offset import _triton_offset_case, _triton_given_blocks_case, "
               "_triton_custom_ops_case, _o3_slots_saved_case, _stages_repeat_case\n" + calls)


INTERPRETER_JOB = _interpreter_job()


@pytest.mark.skipif(HAS_CUDA, reason="interpreter cases run where there is no GPU")
@pytest.mark.beside(INTERPRETER_JOB)
def test_triton_offset_in_the_interpreter() -> None:
    """All interpreter cases in one process (tiny shapes, float32, against the float64 reference); each case
    prints its name first."""
    run_job(INTERPRETER_JOB)


GPU_CASES = [
    # B, S_k, HQ, H, Dk, Dv, q_start, S_q
    pytest.param(1, 8192, 12, 2, 64, 64, 4096, 4096, id="m7c-h6-half"),
    pytest.param(1, 8192, 32, 2, 128, 128, 4096, 4096, id="paper-h16-half"),
    pytest.param(2, 8192, 8, 2, 128, 128, 2003, 3001, id="h4-ragged-keys-after"),
    pytest.param(1, 8192, 12, 2, 64, 64, 8191, 1, id="h6-last-row"),
]


def _gpu_matches(out: torch.Tensor, ref: torch.Tensor, args: list[torch.Tensor], ref_args: list[torch.Tensor], *,
                 seed: int) -> None:
    """A bf16 GPU output against its float64 torch-path reference, then every input's gradient (a seeded
    output gradient) within bf16 tolerance."""
    assert _rel(out, ref) < 2e-2
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.device)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    for name, a, r in zip(NAMES, args, ref_args, strict=True):
        assert a.grad is not None and r.grad is not None, name
        assert _rel(a.grad, r.grad) < 2e-2, (name, _rel(a.grad, r.grad))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "flash"])
@pytest.mark.parametrize("HQ,H,D", [(12, 2, 64), (32, 2, 128)])
def test_gpu_offset_cmp_library_matches_torch_path(impl: str, HQ: int, H: int, D: int) -> None:
    """A context-parallel tail chunk (queries 4093 .. 8191 of 8192 keys) with its compressed branch by a library
    kernel (a rectangle and a causal square merged by their log-sum-exps): output and every gradient."""
    from nsa.ops import triton_path

    hp = NSAParams(l=32, d=16, l_sel=64, n_sel=16, w=512)
    Sk, q0 = 8192, 4093
    x = make_inputs(1, Sk, HQ, H, D, D, l=32, d=16, dtype=torch.bfloat16, device="cuda", seed=22)
    args = _call_args(x, q0, Sk - q0, Sk)
    ref_args = [a.detach().double().requires_grad_(True) for a in args]
    idx = ops.select_blocks(ref_args[0].detach(), ref_args[1].detach(), hp, backend="torch", q_start=q0)
    before = triton_path.path_counts().get(impl, 0)
    try:
        triton_path.set_cmp_path(impl)
        out = ops.nsa_attention(*args, hp, block_idx=idx, q_start=q0)
    finally:
        triton_path.set_cmp_path(None)
    assert triton_path.path_counts().get(impl, 0) == before + 1
    ref = ops.nsa_attention(*ref_args, hp, backend="torch", block_idx=idx, q_start=q0)
    _gpu_matches(out, ref, args, ref_args, seed=23)


@pytest.mark.gpu
@pytest.mark.parametrize("B,Sk,HQ,H,Dk,Dv,q0,sq", GPU_CASES)
def test_gpu_offset_matches_torch_path(B: int, Sk: int, HQ: int, H: int, Dk: int, Dv: int, q0: int, sq: int) -> None:
    """Triton (bf16) with ``q_start`` against the torch path in float64 at the paper's hyper-parameters:
    block indices (near-ties may flip in bf16), then output and every gradient with the same blocks."""
    hp = NSAParams(l=32, d=16, l_sel=64, n_sel=16, w=512)
    x = make_inputs(B, Sk, HQ, H, Dk, Dv, l=32, d=16, dtype=torch.bfloat16, device="cuda", seed=20)
    args = _call_args(x, q0, sq, Sk)
    ref_args = [a.detach().double().requires_grad_(True) for a in args]
    idx = ops.select_blocks(args[0], args[1], hp, backend="triton", q_start=q0)
    ref_idx = ops.select_blocks(ref_args[0].detach(), ref_args[1].detach(), hp, backend="torch", q_start=q0)
    assert idx.shape == ref_idx.shape == (B, sq, H, 16)
    agree = float((idx == ref_idx).float().mean())  # bf16 scores may flip near-ties (as in test_triton_kernels)
    assert agree > (0.97 if sq >= 64 else 0.75), agree
    ops.reset_fallback_counts()
    out = ops.nsa_attention(*args, hp, block_idx=ref_idx, q_start=q0)  # auto: Triton for CUDA tensors
    assert ops.fallback_counts() == {}, "auto did not serve the offset call with Triton"
    ref = ops.nsa_attention(*ref_args, hp, backend="torch", block_idx=ref_idx, q_start=q0)
    _gpu_matches(out, ref, args, ref_args, seed=21)
    for name, a in zip(NAMES, args, strict=True):
        if name in ("k_sel", "v_sel", "k_win", "v_win") and q0 + sq < Sk:
            assert a.grad[:, q0 + sq:].abs().sum() == 0, name


@pytest.mark.gpu
@pytest.mark.parametrize("h", [6, 16])
def test_gpu_split_over_ranks_matches_whole_call(h: int) -> None:
    """Four "ranks" of 2048 rows each (S=8192, bf16, Triton): rows and summed key gradients equal the whole
    call's within bf16 rounding (the same blocks: the whole call's, cut per rank)."""
    hp = NSAParams(l=32, d=16, l_sel=64, n_sel=16, w=512)
    x = make_inputs(1, 8192, 2 * h, 2, 64, 64, l=32, d=16, seed=22)
    _split_check("triton", x, hp, [0, 2048, 4096, 6144, 8192], torch.bfloat16, "cuda", 2e-2)


@pytest.mark.gpu
def test_gpu_given_blocks_at_an_offset() -> None:
    _triton_given_blocks_case("cuda")


@pytest.mark.gpu
def test_gpu_compiled_offset_call_equals_eager() -> None:
    """``torch.compile(fullgraph=True)`` (Inductor) of an offset call: the custom ops' fake implementations
    take ``q_start``; output and gradients equal eager's (the same kernels run)."""
    hp = NSAParams(l=32, d=16, l_sel=64, n_sel=16, w=512)
    x = make_inputs(1, 4096, 12, 2, 64, 64, l=32, d=16, dtype=torch.bfloat16, device="cuda", seed=23)
    q0 = 1500

    def f(*a: torch.Tensor) -> torch.Tensor:
        return ops.nsa_attention(*a, hp, q_start=q0)

    grads = []
    outs = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        args = _call_args(x, q0, 4096 - q0, 4096)
        out = fn(*args)
        out.float().square().sum().backward()
        outs.append(out)
        grads.append([a.grad for a in args])
    torch.testing.assert_close(outs[1], outs[0])  # bf16 defaults; the same forward kernels run
    for name, g_c, g_e in zip(NAMES, grads[1], grads[0], strict=True):
        torch.testing.assert_close(g_c, g_e, atol=1e-2, rtol=1e-2, msg=lambda m, n=name: f"{n}: {m}")
