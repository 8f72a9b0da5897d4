"""Triton NSA kernels against the reference: forward, block indices and every gradient.

CPU: the same kernels run under ``TRITON_INTERPRET=1`` on tiny shapes (S <= 48), in a subprocess.
GPU: bf16/fp16 at S = 1..2k for h = 1, 2, 6, 16, 64 and head dims 64/128/192 (skipped without CUDA).
Outputs are poisoned (NaN-filled allocator memory on GPU) before each call; inputs are fresh random.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import pytest
import torch

from nsa.ops import NSAParams
from tests.conftest import Job, make_inputs, run_job

HAS_CUDA = torch.cuda.is_available()
triton = pytest.importorskip("triton")
NAMES = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")
ROOT = Path(__file__).resolve().parents[1]
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values (unwritten output?)"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _poison(device: torch.device) -> None:
    if device.type == "cuda":
        junk = torch.full((1 << 26,), float("nan"), device=device)
        del junk


def _check(B: int, S: int, HQ: int, H: int, Dk: int, Dv: int, *, l: int, d: int, l_sel: int,  # noqa: E741
           n_sel: int, w: int, dtype: torch.dtype, device: str, tol: float, oracle: str,
           strided: bool = False, window_query: bool = False, cmp_path: str = "kernel") -> None:
    from nsa.ops import triton_path

    triton_path.set_cmp_path(cmp_path)
    try:
        _check_on_path(B, S, HQ, H, Dk, Dv, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, dtype=dtype, device=device,
                       tol=tol, oracle=oracle, strided=strided, window_query=window_query)
        if cmp_path != "kernel":
            assert triton_path.path_counts().get(cmp_path, 0) > 0, triton_path.path_counts()
    finally:
        triton_path.set_cmp_path(None)


def _check_on_path(B: int, S: int, HQ: int, H: int, Dk: int, Dv: int, *, l: int, d: int, l_sel: int,  # noqa: E741
                   n_sel: int, w: int, dtype: torch.dtype, device: str, tol: float, oracle: str,
                   strided: bool, window_query: bool) -> None:
    from nsa.ops import reference, torch_path, triton_path

    dev = torch.device(device)
    x = make_inputs(B, S, HQ, H, Dk, Dv, l=l, d=d, dtype=dtype, device=device)
    assert triton_path.supports(*x.args()) is None
    # window_query: the window branch's own queries (q_win), checked like every other input
    q_win = [make_inputs(B, S, HQ, H, Dk, Dv, l=l, d=d, dtype=dtype, device=device, seed=99).q] if window_query else []
    args = [a.detach().clone().requires_grad_(True) for a in (*x.args(), *q_win)]
    ref_mod = reference if oracle == "reference" else torch_path
    ref_args = [a.detach().double().requires_grad_(True) for a in (*x.args(), *q_win)]
    extra = {"q_win": args[8]} if window_query else {}
    ref_extra = {"q_win": ref_args[8]} if window_query else {}
    args8, ref_args8 = args[:8], ref_args[:8]
    hp = NSAParams(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)

    _poison(dev)
    idx = triton_path.select_blocks(args[0], args[1], hp)
    idx_ref = ref_mod.select_blocks(args[0].detach().double(), args[1].detach().double(), hp)
    assert idx.dtype == torch.int32 and idx.shape == (B, S, H, n_sel)
    agree = float((idx == idx_ref).float().mean())
    # exact in fp32; with bf16/fp16 inputs only near-ties may choose differently
    assert agree == 1.0 if dtype == torch.float32 else agree > 0.97, agree

    _poison(dev)
    out, idx2 = triton_path.nsa_attention(*args8, hp, return_block_idx=True, **extra)
    assert torch.equal(idx2, idx), "nsa_attention chose other blocks than select_blocks"
    inputs = list(args8)
    if strided:  # q, k_sel, v_sel, k_win as views of wider rows (a fused projection): stride(-1) == 1 only
        for i in (0, 3, 4, 5):
            inputs[i] = torch.cat([args[i], args[i]], dim=-1)[..., : args[i].shape[-1]]
            assert not inputs[i].is_contiguous()
    _poison(dev)
    out = triton_path.nsa_attention(*inputs, hp, block_idx=idx_ref, **extra)
    ref = ref_mod.nsa_attention(*ref_args8, hp, block_idx=idx_ref, **ref_extra)
    assert out.shape == ref.shape and out.dtype == dtype
    assert _rel(out, ref) < tol
    grad = torch.randn(ref.shape, dtype=torch.float64, device=device)
    _poison(dev)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    for name, a, r in zip(NAMES + ("q_win",) * window_query, args, ref_args, strict=True):
        if r.grad is None:  # k_cmp / v_cmp with no compressed token (S < l)
            assert a.grad is None or a.grad.abs().sum() == 0
            continue
        assert a.grad is not None, name
        assert _rel(a.grad, r.grad) < tol, (name, _rel(a.grad, r.grad))


CPU_CASES = {
    # id: (B, S, HQ, H, Dk, Dv, l, d, l_sel, n_sel, w)
    "h1-B2-DkneDv": (2, 40, 2, 2, 16, 32, 8, 4, 8, 2, 10),
    "h6": (1, 48, 6, 1, 16, 16, 8, 4, 16, 3, 16),
    "h3-nsel1-D8": (1, 36, 6, 2, 8, 8, 16, 8, 8, 1, 8),
    "S-lt-l": (1, 10, 4, 1, 16, 16, 16, 8, 16, 2, 4),
    "h2-strided-views": (1, 40, 4, 2, 16, 16, 8, 4, 8, 3, 12, True),
    "h2-window-query": (1, 40, 4, 2, 16, 16, 8, 4, 8, 3, 12, False, True),
    # selection blocks as long as the compression blocks and more of them (nsa.l_sel=32, nsa.n_sel=32 at scale)
    "h2-lsel-eq-l-nsel5": (1, 48, 6, 2, 16, 16, 8, 4, 8, 5, 12, False, True),
    # the compressed branch as square causal attention over virtual rows (cmp_sdpa, plain torch on CPU):
    # S=48 leaves a partial last virtual row, S=43 a whole one; with and without the window's own queries
    "h6-cmp-sdpa": (1, 48, 6, 1, 16, 16, 8, 4, 16, 3, 16, False, False, "math"),
    "h2-B2-cmp-sdpa-window-query": (2, 43, 4, 2, 16, 16, 8, 4, 8, 3, 12, True, True, "math"),
}


# the other loop order and kernel options on the same kind of case: (case id, tile overrides)
CPU_TUNED_CASES = {
    "h16-row": ((1, 24, 16, 1, 16, 16, 8, 4, 8, 2, 8), {}),
    "h16-fsa-slabs": ((1, 24, 16, 1, 16, 16, 8, 4, 8, 2, 8), {"sel_mode": "fsa", "score_slab": 7}),
    "h6-row-tma-slabs": (CPU_CASES["h6"], {"sel_mode": "row", "sel_tma": 1, "score_slab": 16}),
    "h2-row-strided": (CPU_CASES["h2-strided-views"], {"sel_mode": "row", "sel_tma": 1}),
    # dq partials from the dk/dv programs for a large group (the other way than its default)
    "h16-part-dq": ((1, 24, 16, 1, 16, 16, 8, 4, 8, 2, 8), {"sel_dq": "part"}),
    # dq added atomically by the dk/dv programs (no per-pair buffer): after the compressed branch's, and first
    # (the compressed branch given, the window's query its own: dq zeroed, then added into)
    "h6-atomic-dq": (CPU_CASES["h6"], {"sel_dq": "atomic"}),
    "h6-atomic-dq-first": ((1, 24, 6, 1, 16, 16, 8, 4, 8, 2, 8, False, True, "math"), {"sel_dq": "atomic"}),
    # the FSA order's work list by the PyTorch operators (the kernels are the default; forward and backward read it)
    "h6-worklist-ops": (CPU_CASES["h6"], {"sel_wl": "ops"}),
    # the overlap product as the GPU runs it by default (p scaled by 2**14 in fp16; the interpreter's own is fp32)
    "h6-score-fp16": (CPU_CASES["h6"], {"score_prec": "fp16"}),
    "h16-score-fp16": ((1, 24, 16, 1, 16, 16, 8, 4, 8, 2, 8), {"score_prec": "fp16"}),
}


def _cpu_case(B, S, HQ, H, Dk, Dv, l, d, l_sel, n_sel, w, strided=False, window_query=False,  # noqa: E741
              cmp_path="kernel", tune=None) -> None:
    from nsa.ops import tile_overrides

    with tile_overrides(tune):
        _check(B, S, HQ, H, Dk, Dv, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, dtype=torch.float32,
               device="cpu", tol=2e-5, oracle="reference", strided=strided, window_query=window_query,
               cmp_path=cmp_path)


def _chunked_case() -> None:
    """Issue 53: the FSA order in query chunks (the per-pair buffers capped, here at one byte, chunks of 16
    rows of each batch row; the forward, and the backward too with dq partials, ``sel_dq=part``, where its
    default adds dq atomically): the same outputs and gradients as the reference, the forward keeping no pair list,
    and the fake (compile-time) outputs of the operator the real ones' shapes."""
    from nsa.ops import triton_path
    from nsa.ops._triton import selection

    saved = selection.PARTIAL_BYTES, selection.CHUNK_ROWS
    selection.PARTIAL_BYTES, selection.CHUNK_ROWS = 1, 16
    try:
        B, S, HQ, H, Dk, Dv, l, d, l_sel, n_sel, w = 2, 40, 4, 2, 16, 8, 8, 4, 8, 3, 12  # noqa: E741
        assert selection.query_chunks(B, S, HQ, n_sel, Dk) == [(0, 0, 16), (0, 16, 32), (0, 32, 40),
                                                                 (1, 0, 16), (1, 16, 32), (1, 32, 40)]
        _cpu_case(B, S, HQ, H, Dk, Dv, l, d, l_sel, n_sel, w)
        _cpu_case(B, S, HQ, H, Dk, Dv, l, d, l_sel, n_sel, w, tune={"sel_dq": "part"})  # the backward too
        x = make_inputs(B, S, HQ, H, Dk, Dv, l=l, d=d, dtype=torch.float32, seed=3)
        real = triton_path.attention_fwd(*x.args(), None, l, d, l_sel, n_sel, w, Dk**-0.5)
        fake = triton_path._attention_fwd_fake(*x.args(), None, l, d, l_sel, n_sel, w, Dk**-0.5)
        assert [tuple(t.shape) for t in real] == [tuple(t.shape) for t in fake]
        assert tuple(real[-1].shape) == (B * H, 0)
    finally:
        selection.PARTIAL_BYTES, selection.CHUNK_ROWS = saved


def _work_list_case(device: str = "cpu") -> None:
    """The work list by three Triton launches (the default, and ``sel_wl=sort`` for any number of blocks) is
    the operators' list (``sel_wl=ops``) bit for bit: random block lists with ``-1`` holes (seed 7), several
    segments, queries at an offset, a strided view, the backward's item size; lists too long for the one-hot
    bins go to the sorts by default."""
    from nsa.ops import fallback_counts, reset_fallback_counts, tile_overrides
    from nsa.ops._triton import selection, worklist

    gen = torch.Generator().manual_seed(7)
    for B, S, H, n, l_sel, q_start, backward in ((1, 40, 2, 3, 8, 0, False), (2, 300, 1, 5, 16, 0, False),
                                                  (1, 260, 2, 4, 8, 24, True), (1, 8, 1, 2, 4, 0, False)):
        nb = selection.num_blocks(S, l_sel, q_start)
        idx = torch.randint(-1, nb, (B, H, S, n), generator=gen, dtype=torch.int32).permute(0, 2, 1, 3)
        idx = idx.to(device)
        with tile_overrides({"sel_wl": "ops"}):
            want = selection.work_list(idx, l_sel, q_start, backward)
        got = selection.work_list(idx, l_sel, q_start, backward)  # the default: the kernels
        assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want), (B, S, H, n, l_sel, q_start)
        with tile_overrides({"sel_wl": "sort"}):
            got = selection.work_list(idx, l_sel, q_start, backward)
        assert got.dtype == torch.int32 and torch.equal(got, want), ("sort", B, S, H, n, l_sel, q_start)
    assert worklist.fits(255) and not worklist.fits(256)
    # the segment sorts serve any number of blocks: 300 and 1,100 (past the one-hot kernels' 255), 3 segments
    reset_fallback_counts()
    for B2, S2, H2, n2, l_sel2, q2, bwd2 in ((1, 300, 2, 3, 1, 0, False), (1, 700, 1, 5, 1, 400, True)):
        nb = selection.num_blocks(S2, l_sel2, q2)
        many = torch.randint(-1, nb, (B2, H2, S2, n2), generator=gen, dtype=torch.int32).permute(0, 2, 1, 3)
        many[..., 0] = 0  # every position chooses block 0 (the forced first block): the most work items
        if bwd2:
            many[..., 1] = 1  # and block 1 as often: two blocks share the largest count
        many = many.to(device)
        with tile_overrides({"sel_wl": "ops"}):
            want2 = selection.work_list(many, l_sel2, q2, bwd2)
        with tile_overrides({"sel_wl": "sort"}):
            got2 = selection.work_list(many, l_sel2, q2, bwd2)
        assert torch.equal(got2, want2), ("sort", nb)
        assert torch.equal(selection.work_list(many, l_sel2, q2, bwd2), want2), ("default", nb)
    # the kernels ran: a launch that failed to compile would have handed this and every later list of the
    # process to the operators (counted once, at the first launch, so the counts alone cannot tell)
    assert fallback_counts() == {} and worklist.FIRST_SORTED.ok and worklist.FIRST_BUILD.ok
    # histograms past their memory budget (quadratic in S): the operators build the list, nothing counted
    saved_budget, saved_build = worklist.SORT_HIST_BYTES, worklist.build_sorted
    worklist.SORT_HIST_BYTES = 1024

    def never(*_args: object) -> None:
        raise AssertionError("the sorts ran past their budget")

    worklist.build_sorted = never  # type: ignore[assignment]
    try:
        assert not worklist.sorted_fits(1, 900, 300)
        assert torch.equal(selection.work_list(many, l_sel2, q2, bwd2), want2)
        assert fallback_counts() == {}
    finally:
        worklist.SORT_HIST_BYTES, worklist.build_sorted = saved_budget, saved_build
    if device != "cpu":
        return
    # a Triton that cannot compile the kernels: the operators' list, each call counted as a fallback
    from triton.compiler.errors import CompilationError

    def refuse(*_args: object) -> None:
        raise CompilationError(None, None, "forced by the test")

    saved = worklist.build
    worklist.build, worklist.FIRST_BUILD.ok = refuse, None
    reset_fallback_counts()
    try:
        assert torch.equal(selection.work_list(idx, l_sel, q_start, backward), want)
        assert torch.equal(selection.work_list(idx, l_sel, q_start, backward), want)
        assert fallback_counts() == {"work_list:kernels->operators:CompilationError": 2}
    finally:
        worklist.build, worklist.FIRST_BUILD.ok = saved, None


def _messy_blocks_case(device: str = "cpu") -> None:
    """A given block list in any order, with duplicates, ``-1`` anywhere and blocks past the query's
    own: the same keys as the reference reads (each block once, future blocks empty), both loop orders."""
    from nsa.ops import reference, tile_overrides, triton_path

    B, S, HQ, H, D, l, d, l_sel, n_sel, w = 1, 40, 4, 2, 16, 8, 4, 8, 5, 6  # noqa: E741
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = make_inputs(B, S, HQ, H, D, D, l=l, d=d, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(-1, S // l_sel + 1, (B, S, H, n_sel), generator=gen, dtype=torch.int32)
    idx[..., 1] = idx[..., 0]  # a duplicate in every row
    hp = NSAParams(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
    ref_args = [a.detach().double().cpu().requires_grad_(True) for a in x.args()]
    ref = reference.nsa_attention(*ref_args, hp, block_idx=idx)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    ref.backward(grad)
    for mode in ("row", "fsa"):
        args = [a.detach().clone().requires_grad_(True) for a in x.args()]
        with tile_overrides({"sel_mode": mode}):
            out = triton_path.nsa_attention(*args, hp, block_idx=idx.to(device))
            out.backward(grad.to(device, dtype))
        tol = 2e-5 if device == "cpu" else 2e-2
        assert _rel(out, ref.to(out.device)) < tol, mode
        for name, a, r in zip(NAMES, args, ref_args, strict=True):
            assert a.grad is not None and _rel(a.grad, r.grad.to(a.device)) < tol, (mode, name)


@pytest.mark.gpu
def test_messy_block_lists_gpu() -> None:
    _messy_blocks_case("cuda")


def _interpreter_job() -> Job:
    """All CPU cases in one interpreter process: both loop orders of the selected branch, TMA descriptors and
    score slabs included; each case prints its name first."""
    calls = "".join(f"print({name!r}, flush=True); _cpu_case(*{args!r})\n" for name, args in CPU_CASES.items())
    calls += "".join(f"print({name!r}, flush=True); _cpu_case(*{args!r}, tune={tune!r})\n"
                     for name, (args, tune) in CPU_TUNED_CASES.items())
    checks = ("from nsa.ops import triton_path\n"
              "assert triton_path.supports(torch.zeros(1, 8, 1, 16)) is None\n"
              "assert triton_path.supports(torch.zeros(1, 8, 1, 512)) == 'head dim 512'\n"
              "_dispatcher_case()\n")
    calls += "print('messy block lists', flush=True); _messy_blocks_case()\n"
    calls += "print('chunked selection', flush=True); _chunked_case()\n"
    calls += "print('work list kernels', flush=True); from tests.test_triton_kernels import _work_list_case; _work_list_case()\n"
    calls += "print('regroup copies', flush=True); from tests.test_cmp_sdpa import _regroup_case; _regroup_case()\n"
    calls += ("from tests.test_rotary import _one_launch_fallback_case, _rotary_case\n"
              "_rotary_case('cpu', torch.bfloat16, 1e-2); _rotary_case('cpu', torch.float32, 1e-5)\n"
              "_one_launch_fallback_case()\n"
              "from nsa.ops import tile_overrides\n"
              "with tile_overrides({'rot_launch': 'parts'}): _rotary_case('cpu', torch.float32, 1e-5)\n")
    # every launch above, compiled for sm_90 at the end (tests/triton_aot.py: the interpreter does not type
    # kernels as the compiler does; a kernel that fails to compile on a GPU only falls back there, counted)
    calls += f"triton_aot.compile_recorded({str(AOT_SPECS)!r})\n"
    return Job("from tests import triton_aot\ntriton_aot.record()\n"
               "from tests.test_triton_kernels import _chunked_case, _cpu_case, _dispatcher_case, _messy_blocks_case\n"
               + checks + calls, timeout=600)


AOT_SPECS = Path(tempfile.gettempdir()) / f"nsa-tests-aot-{os.getpid()}.json"
INTERPRETER_JOB = _interpreter_job()


@pytest.mark.skipif(HAS_CUDA, reason="interpreter cases run where there is no GPU")
@pytest.mark.beside(INTERPRETER_JOB)
def test_interpreter_matches_reference() -> None:
    """All CPU cases in one interpreter process (about 60-110 s on 2 busy cores, beside the other tests), then
    every kernel launch they made compiled for sm_90 by Triton's compiler (about a minute more)."""
    run_job(INTERPRETER_JOB)


def test_supports_reasons() -> None:
    from nsa.ops import triton_path

    x = torch.zeros(1, 8, 1, 16, dtype=torch.float64)
    reason = triton_path.supports(x)
    assert reason is not None and ("dtype" in reason or "tensor" in reason)
    if not HAS_CUDA and not INTERPRETING:
        assert triton_path.supports(x.float()) == "cpu tensor"


@pytest.mark.skipif(not HAS_CUDA and not INTERPRETING, reason="CPU: part of the interpreter test")
def test_dispatcher_uses_triton_without_fallback() -> None:
    _dispatcher_case()


def _dispatcher_case() -> None:
    from nsa import ops

    x = make_inputs(1, 48, 4, 2, 16, 16, l=8, d=4, dtype=torch.bfloat16 if HAS_CUDA else torch.float32,
                    device="cuda" if HAS_CUDA else "cpu")
    ops.reset_fallback_counts()
    hp = NSAParams(l=8, d=4, l_sel=16, n_sel=2, w=16)
    out = ops.nsa_attention(*x.args(), hp, backend="triton")
    assert ops.fallback_counts() == {}
    ref = ops.nsa_attention(*[a.double() for a in x.args()], hp, backend="torch",
                            block_idx=ops.select_blocks(x.q.double(), x.k_cmp.double(), hp))
    assert _rel(out, ref) < (2e-2 if HAS_CUDA else 1e-5)


GPU_CASES = [
    # B, S, HQ, H, Dk, Dv, dtype
    pytest.param(2, 1024, 2, 2, 64, 64, torch.bfloat16, id="h1-D64"),
    pytest.param(1, 1500, 4, 2, 128, 128, torch.bfloat16, id="h2-D128-ragged"),
    pytest.param(2, 1024, 12, 2, 64, 64, torch.bfloat16, id="h6-D64-m7c"),
    pytest.param(1, 2048, 12, 2, 64, 64, torch.float16, id="h6-fp16"),
    pytest.param(1, 1024, 32, 2, 128, 128, torch.bfloat16, id="h16-D128"),
    pytest.param(1, 1024, 64, 1, 128, 128, torch.bfloat16, id="h64-D128"),
    pytest.param(1, 1024, 8, 2, 192, 128, torch.bfloat16, id="h4-Dk192-Dv128"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,HQ,H,Dk,Dv,dtype", GPU_CASES)
def test_gpu_matches_torch_path(B, S, HQ, H, Dk, Dv, dtype) -> None:
    _check(B, S, HQ, H, Dk, Dv, l=32, d=16, l_sel=64, n_sel=16, w=512, dtype=dtype, device="cuda",
           tol=2e-2, oracle="torch", strided=HQ == 12)


@pytest.mark.gpu
@pytest.mark.parametrize("sel_dq", ["row", "part", "atomic"])
@pytest.mark.parametrize("HQ,window_query", [(64, False), (12, True)])
def test_gpu_sel_dq_ways_match_torch_path(sel_dq: str, HQ: int, window_query: bool) -> None:
    """Both ways of forming the selected branch's dq (tile key ``sel_dq``) against the torch path."""
    from nsa.ops import tile_overrides

    with tile_overrides({"sel_dq": sel_dq}):
        _check(1, 1500, HQ, 2 if HQ == 12 else 4, 64, 64, l=32, d=16, l_sel=64, n_sel=16, w=512,
               dtype=torch.bfloat16, device="cuda", tol=2e-2, oracle="torch", window_query=window_query)


@pytest.mark.gpu
def test_gpu_work_list_kernels_equal_the_operators() -> None:
    """The work-list kernels on the GPU: the operators' list (``sel_wl=ops``) bit for bit (random lists, several
    segments, an offset), and at m7c's 2k-16k shapes (h = 6, l_sel = 64, n_sel = 16) and 64k (1,024 blocks: the
    sorts) from random block lists (seed 11)."""
    from nsa.ops import tile_overrides
    from nsa.ops._triton import selection

    _work_list_case("cuda")
    gen = torch.Generator(device="cuda").manual_seed(11)
    for B, S in ((16, 2048), (4, 8192), (1, 16320), (1, 65536)):
        nb = selection.num_blocks(S, 64)
        idx = torch.randint(-1, nb, (B, S, 2, 16), device="cuda", dtype=torch.int32, generator=gen)
        for backward in (False, True):
            with tile_overrides({"sel_wl": "ops"}):
                want = selection.work_list(idx, 64, 0, backward)
            assert torch.equal(selection.work_list(idx, 64, 0, backward), want), (B, S, backward)


@pytest.mark.gpu
@pytest.mark.parametrize("sel_dq", ["part", "atomic"])
@pytest.mark.parametrize("B,S", [(1, 4500), (2, 2100)])
def test_gpu_chunked_selection_matches_torch_path(B: int, S: int, sel_dq: str) -> None:
    """The FSA order in query chunks (``sel_partial_mib=1``: chunks of 1024 rows of each batch row, the last one
    short; with ``atomic`` dq the forward alone) against the torch path, forward and every gradient, the window's
    own query included."""
    from nsa.ops import tile_overrides
    from nsa.ops._triton.selection import query_chunks

    with tile_overrides({"sel_partial_mib": 1, "sel_dq": sel_dq}):
        assert len(query_chunks(B, S, 12, 16, 64)) == B * -(-S // 1024)
        _check(B, S, 12, 2, 64, 64, l=32, d=16, l_sel=64, n_sel=16, w=512, dtype=torch.bfloat16, device="cuda",
               tol=2e-2, oracle="torch", window_query=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "flash"])
@pytest.mark.parametrize("B,S,HQ,H,D,window_query", [(1, 1500, 12, 2, 64, True), (2, 1024, 8, 2, 128, False),
                                                       (1, 1040, 64, 4, 128, True)])
def test_gpu_cmp_sdpa_matches_torch_path(impl: str, B: int, S: int, HQ: int, H: int, D: int,
                                         window_query: bool) -> None:
    """The compressed branch by cuDNN's or FlashAttention's kernel over virtual rows: forward and every
    gradient against the torch path (ragged and whole last virtual rows)."""
    _check(B, S, HQ, H, D, D, l=32, d=16, l_sel=64, n_sel=16, w=512, dtype=torch.bfloat16, device="cuda",
           tol=2e-2, oracle="torch", window_query=window_query, cmp_path=impl)


@pytest.mark.gpu
@pytest.mark.parametrize("window_query", [False, True])
def test_gpu_cmp_output_kept_virtual_matches_torch_path(window_query: bool) -> None:
    """Tile key ``o3_slots=2``: the compressed branch's output kept only in cuDNN's virtual layout (the
    combine reading rows of its own, the gate gradient formed in the copy of ``do``)."""
    from nsa.ops import tile_overrides

    with tile_overrides({"o3_slots": 2}):
        _check(1, 1500, 12, 2, 64, 64, l=32, d=16, l_sel=64, n_sel=16, w=512, dtype=torch.bfloat16,
               device="cuda", tol=2e-2, oracle="torch", window_query=window_query, cmp_path="cudnn")


@pytest.mark.gpu
@pytest.mark.parametrize("HQ", [2, 12])
def test_gpu_window_query_matches_torch_path(HQ: int) -> None:
    """The window branch's own queries (``q_win``): forward and every gradient, ``q_win``'s included."""
    _check(1, 1500, HQ, 2, 64, 64, l=32, d=16, l_sel=64, n_sel=16, w=512, dtype=torch.bfloat16, device="cuda",
           tol=2e-2, oracle="torch", window_query=True)


def _top_blocks_case(device: str) -> None:
    """The top-n kernel on scores full of ties (small integers), on distinct scores (a permutation of
    1 .. n_blocks scaled by 2**-20) and on scores one ulp apart (1 + k * 2**-23) equals the spec's choice row by
    row, with 64-bit keys and with 32-bit rounds (``topn_key=32``, which fall back to the 64-bit keys on ties)."""
    from nsa.ops import tile_overrides
    from nsa.ops._triton.scores import top_blocks
    from nsa.ops.reference import _choose

    gen = torch.Generator().manual_seed(12)
    cases = [(1, 1, 40, 4, 3, "ties"), (2, 3, 77, 8, 5, "ties"), (1, 2, 150, 4, 16, "ties"),
             (1, 2, 600, 2, 16, "distinct"), (1, 1, 300, 2, 16, "ulps"), (1, 2, 200, 8, 16, "ties")]
    for (B, H, S, l_sel, n_sel, kind), bits in itertools.product(cases, (64, 32)):
        nb = -(-S // l_sel)
        if kind == "ties":
            P = torch.randint(0, 4, (B * H, S, nb), generator=gen).float()
            P[:, :, 1] = 0.0  # a column of equal zeros next to the forced block 0
        else:
            P = torch.stack([torch.randperm(nb, generator=gen) for _ in range(B * H * S)]).view(B * H, S, nb)
            P = (P.float() + 1) * 2.0**-20 if kind == "distinct" else 1.0 + P.double() * 2.0**-23
            P = P.float()
        idx = torch.full((B, S, H, n_sel), -7, dtype=torch.int32, device=device)
        with tile_overrides({"topn_key": bits}):
            top_blocks(P.to(device), idx, 0, S, l_sel=l_sel)
        idx = idx.cpu()
        for b in range(B):
            for g in range(H):
                for t in range(S):
                    want = _choose(P[b * H + g, t].tolist(), t, l_sel, n_sel)
                    got = idx[b, t, g].tolist()
                    assert got == want + [-1] * (n_sel - len(want)), (B, H, S, bits, t, got, want)


@pytest.mark.gpu
def test_top_blocks_ties_gpu() -> None:
    _top_blocks_case("cuda")


TOP_BLOCKS_JOB = Job("from tests.test_triton_kernels import _top_blocks_case\n_top_blocks_case('cpu')")


@pytest.mark.skipif(HAS_CUDA, reason="interpreter cases run where there is no GPU")
@pytest.mark.beside(TOP_BLOCKS_JOB)
def test_top_blocks_ties_interpreter() -> None:
    run_job(TOP_BLOCKS_JOB)
