"""``nsa::split_rotate``: a fused projection's parts, the rotated ones RoPE'd, against RoPE applied slice by slice
(forward and gradient), and the attention layer's projection through it against the unfused path.

CPU: float64 exactly (and ``gradcheck``, ``opcheck``); the Triton kernels under ``TRITON_INTERPRET=1`` as a case of
the interpreter job (``tests/test_triton_kernels.py``); on a GPU in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from nsa.model import NSAAttention
from nsa.model.gates import GateParams
from nsa.ops import NSAParams
from nsa.ops.rotary import rotate, split_rotate

HAS_CUDA = torch.cuda.is_available()
WIDTHS = [16, 8, 8, 8, 8, 6]  # q (2 heads), k, v, k, v, a gate input: head dim 8
ROTATE = [True, True, False, True, False, False]


def _sliced(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, D: int) -> list[torch.Tensor]:
    """The reference: each part a slice of ``y``, rotated by :func:`rotate` where asked."""
    B, S, _ = y.shape
    out, c = [], 0
    for w, rot in zip(WIDTHS, ROTATE, strict=True):
        seg = y[..., c : c + w]
        out.append(rotate(seg.reshape(B, S, w // D, D), cos[:, :, None], sin[:, :, None]).reshape(B, S, w)
                   if rot else seg)
        c += w
    return out


def _inputs(device: str, dtype: torch.dtype, per_batch: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    B, S, D = 2, 37, 8
    wide = torch.randn(B, S, sum(WIDTHS) + 5, generator=g, dtype=torch.float64)  # y a strided slice of it
    y = wide[..., 3 : 3 + sum(WIDTHS)].to(device=device, dtype=dtype).requires_grad_()
    tab = torch.float64 if dtype == torch.float64 else torch.float32
    if per_batch:
        ang = torch.rand(B, S, D // 2, generator=g, dtype=torch.float64) * 6.3
    else:
        ang = torch.arange(S, dtype=torch.float64)[None, :, None] * torch.rand(D // 2, generator=g, dtype=torch.float64)
    return y, ang.cos().to(device=device, dtype=tab), ang.sin().to(device=device, dtype=tab)


def _rotary_case(device: str, dtype: torch.dtype, tol: float) -> None:
    """Outputs and ``dy`` of the op against :func:`_sliced` (shared and per-batch tables), within ``tol``
    relative (bf16: one rounding apart)."""
    for per_batch in (False, True):
        y, cos, sin = _inputs(device, dtype, per_batch)
        outs = split_rotate(y, cos, sin, WIDTHS, ROTATE, 8)
        ref = _sliced(y, cos, sin, 8)
        g = torch.Generator().manual_seed(1)
        grads = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for o in outs]
        for o, r in zip(outs, ref, strict=True):
            assert o.is_contiguous() and o.shape == r.shape
            torch.testing.assert_close(o.double(), r.double(), rtol=tol, atol=tol)
        dy = torch.autograd.grad(outs, y, grads, retain_graph=True)[0]
        dy_ref = torch.autograd.grad(ref, y, grads)[0]
        torch.testing.assert_close(dy.double(), dy_ref.double(), rtol=tol, atol=tol)
        # an unused part: its columns of dy are zero, the others as before
        dy_some = torch.autograd.grad(outs[:-1], y, grads[:-1])[0]
        assert (dy_some[..., -WIDTHS[-1]:] == 0).all()
        torch.testing.assert_close(dy_some[..., : -WIDTHS[-1]], dy[..., : -WIDTHS[-1]])
    print(f"split_rotate {device} {dtype}: ok", flush=True)


def _one_launch_fallback_case() -> None:
    """Where Triton cannot compile the one-launch kernel, the parts move a launch each: the same results, every
    call counted as a fallback, and the one-launch kernel not tried again in the process."""
    from triton.compiler.errors import CompilationError

    from nsa.ops import fallback_counts, reset_fallback_counts, rotary
    from nsa.ops._triton import rotary as kernels

    tried = []

    def refuse(*_args: object, **_kw: object) -> None:
        tried.append(1)
        raise CompilationError(None, None, "forced by the test")

    saved = kernels.move_parts
    kernels.move_parts, rotary._ONE_LAUNCH.ok = refuse, None
    reset_fallback_counts()
    try:
        _rotary_case("cpu", torch.float32, 1e-5)
        assert len(tried) == 1 and rotary._ONE_LAUNCH.ok is False
        counts = fallback_counts()
        assert list(counts) == ["split_rotate:one launch->a launch per part:CompilationError"], counts
        assert sum(counts.values()) > 1, counts  # the calls after the first are counted too
    finally:
        kernels.move_parts, rotary._ONE_LAUNCH.ok = saved, None


def test_split_rotate_matches_slices_float64() -> None:
    """seed 0: exactly the slice-by-slice rotation, forward and backward, on CPU."""
    _rotary_case("cpu", torch.float64, 0.0)


def test_split_rotate_gradcheck_and_opcheck() -> None:
    y, cos, sin = _inputs("cpu", torch.float64, per_batch=True, seed=2)
    assert torch.autograd.gradcheck(lambda t: split_rotate(t, cos, sin, WIDTHS, ROTATE, 8), (y,))
    torch.library.opcheck(torch.ops.nsa.split_rotate.default, (y.detach().requires_grad_(), cos, sin, WIDTHS, ROTATE, 8))


def test_split_rotate_rejects_bad_widths() -> None:
    y, cos, sin = _inputs("cpu", torch.float64, per_batch=False)
    with pytest.raises(ValueError, match="do not make"):
        split_rotate(y, cos, sin, [8, 8], [True, False], 8)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        split_rotate(y, cos, sin, [12, 42], [True, False], 8)


@pytest.mark.parametrize("window_query,shared_kv", [(False, False), (True, False), (True, True)])
def test_projection_through_the_op_equals_unfused(window_query: bool, shared_kv: bool) -> None:
    """seed 0: :meth:`NSAAttention.project` (fused: one operator) against the unfused path (taken when key positions
    are given), every output and every parameter's gradient, float64."""
    torch.manual_seed(0)
    attn = NSAAttention(24, 4, 2, 8, 6, NSAParams(l=4, d=2, l_sel=4, n_sel=2, w=6), GateParams(),
                        window_query=window_query, shared_kv=shared_kv, kv_speed=2.0).double()
    x = torch.randn(2, 11, 24, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(11)
    names = ("q", "k_cmp_raw", "v_cmp_raw", "k_sel", "v_sel", "k_win", "v_win", "gates", "q_win")

    def run(**kw: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        p = attn.project(x, pos, **kw)
        outs = [getattr(p, n) for n in names if getattr(p, n) is not None]
        loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum() for o in outs)
        return outs, list(torch.autograd.grad(loss, [x, *attn.parameters()], allow_unused=True))

    fused, g_fused = run()
    plain, g_plain = run(kv_positions=pos)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(g_fused, g_plain, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_gpu_split_rotate_matches_slices(dtype: torch.dtype, tol: float) -> None:
    _rotary_case("cuda", dtype, tol)
