"""A fused input projection's output split into its parts, the rotated ones RoPE'd, with a backward that
writes the projection's gradient in one pass per part (``nsa::split_rotate``).

``y [B, S, N]`` is one GEMM's output over several weights side by side (queries, keys, values, gate inputs);
``widths`` are their column counts, ``rotate`` which of them turn by RoPE (rotate-half layout, per head of
``head_dim`` columns, in float32) at the table ``cos``/``sin`` ``[1|B, S, head_dim/2]``. Each part comes back
as a contiguous ``[B, S, width]``. The backward receives the parts' gradients and writes ``dy`` directly: each
part's columns from its own pass (rotated back by minus the angle, or copied), so a compiled step never builds
the gradient of the concatenation as one pointwise kernel that picks every element's source through a chain of
selects and evaluates the rotations' backward inside it (at m7c-125m, 2k: ~6x its bytes, 8 ms a step;
docs/kernels.md).

On CUDA (and under ``TRITON_INTERPRET=1``) every part moves in one Triton launch each way (the forward's
split, the backward's ``dy``; :mod:`nsa.ops._triton.rotary`), a launch per part where that kernel cannot
compile (or with the tile key ``rot_launch=parts``); elsewhere the
same arithmetic in PyTorch, identical to :func:`rotate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nsa.ops._triton import interpreting, tuned
from nsa.ops.fallbacks import FirstLaunch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, D]`` rotated at the table ``cos``/``sin`` (broadcast to ``[B, S, 1, D/2]``), computed in
    the table's dtype and returned in ``x``'s: the reference arithmetic of RoPE."""
    half = x.shape[-1] // 2
    xf = x.to(cos.dtype)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _fast(t: torch.Tensor) -> bool:
    return (t.is_cuda or interpreting()) and t.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _move(src: torch.Tensor, dst: torch.Tensor, rot: bool, cos: torch.Tensor, sin: torch.Tensor,
          head_dim: int, sign: int) -> None:
    """``dst = rotate(src)`` (``sign = -1``: by minus the angle) or a copy; both ``[B, S, width]``."""
    B, S, w = src.shape
    if _fast(dst):
        from nsa.ops._triton import rotary as kernels

        s2 = src.reshape(B * S, w) if src.stride(-1) == 1 else src.contiguous().view(B * S, w)
        d2 = dst.view(B * S, w) if dst.is_contiguous() else dst.reshape(B * S, w)
        assert d2.data_ptr() == dst.data_ptr() and d2.stride(-1) == 1
        kernels.move(s2, d2, cos.contiguous() if rot else None, sin.contiguous() if rot else None, S,
                     head_dim, sign)
        return
    if rot:
        c, s = cos[:, :, None, :], sin[:, :, None, :] * sign
        dst.copy_(rotate(src.reshape(B, S, w // head_dim, head_dim), c, s).view(B, S, w))
    else:
        dst.copy_(src)


# the first one-launch move of the process is guarded: where this Triton cannot compile it, a launch per part
_ONE_LAUNCH = FirstLaunch("split_rotate:one launch->a launch per part")


def _one_launch(srcs: list[torch.Tensor | None], dsts: list[torch.Tensor], rotate: Sequence[bool],
                cos: torch.Tensor, sin: torch.Tensor, S: int, head_dim: int, sign: int) -> bool:
    """Every part moved by one Triton launch (:func:`nsa.ops._triton.rotary.move_parts`); False where the
    caller moves them a launch each (tile key ``rot_launch=parts``, or a Triton that cannot compile it:
    ``_ONE_LAUNCH``)."""
    if str(tuned("rot_launch", "one")) == "parts":
        return False
    from nsa.ops._triton import rotary as kernels

    def launch() -> bool:
        kernels.move_parts(srcs, dsts, list(rotate), cos.contiguous(), sin.contiguous(), S, head_dim, sign)
        return True

    return _ONE_LAUNCH.run(launch) is not None


def _check(y: torch.Tensor, widths: Sequence[int], rotate_: Sequence[bool], head_dim: int) -> None:
    if len(widths) != len(rotate_) or sum(widths) != y.shape[-1]:
        raise ValueError(f"split_rotate: widths {list(widths)} (rotate {list(rotate_)}) do not make y's "
                         f"{y.shape[-1]} columns")
    if any(r and w % head_dim for w, r in zip(widths, rotate_, strict=True)):
        raise ValueError(f"split_rotate: a rotated width is not a multiple of head_dim {head_dim}")


@torch.library.custom_op("nsa::split_rotate", mutates_args=())
def split_rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, widths: Sequence[int],
                 rotate: Sequence[bool], head_dim: int) -> list[torch.Tensor]:
    """The parts of ``y [B, S, N]`` (module docstring), each a new contiguous ``[B, S, width]``."""
    _check(y, widths, rotate, head_dim)
    B, S, N = y.shape
    outs = [y.new_empty(B, S, w) for w in widths]
    if _fast(y) and y.stride(-1) == 1:
        y2 = y.reshape(B * S, N)
        if _one_launch([y2[:, c - w : c] for c, w in zip(_ends(widths), widths, strict=True)],
                       [o.view(B * S, w) for o, w in zip(outs, widths, strict=True)], rotate, cos, sin, S,
                       head_dim, 1):
            return outs
    for out, c, w, rot in zip(outs, _ends(widths), widths, rotate, strict=True):
        _move(y[..., c - w : c], out, rot, cos, sin, head_dim, 1)
    return outs


def _ends(widths: Sequence[int]) -> list[int]:
    """Each part's end column."""
    ends, c = [], 0
    for w in widths:
        c += w
        ends.append(c)
    return ends


@split_rotate.register_fake
def _(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, widths: Sequence[int], rotate: Sequence[bool],
      head_dim: int) -> list[torch.Tensor]:
    B, S, _ = y.shape
    return [y.new_empty(B, S, w) for w in widths]


@torch.library.custom_op("nsa::split_rotate_backward", mutates_args=())
def split_rotate_backward(grads: Sequence[torch.Tensor | None], cos: torch.Tensor, sin: torch.Tensor,
                          shape: Sequence[int], dtype: torch.dtype, widths: Sequence[int],
                          rotate: Sequence[bool], head_dim: int) -> torch.Tensor:
    """``dy`` (``shape`` ``[B, S, N]``, ``dtype``, on ``cos``'s device) from the parts' gradients (``None``:
    that part's columns are zero)."""
    B, S, N = shape
    dy = torch.empty(B, S, N, dtype=dtype, device=cos.device)
    parts = [None if g is None else g.view(B, S, w) if g.is_contiguous() else g.reshape(B, S, w)
             for g, w in zip(grads, widths, strict=True)]
    if _fast(dy) and all(p is None or p.stride(-1) == 1 for p in parts):
        dy2 = dy.view(B * S, N)
        if _one_launch([None if p is None else p.reshape(B * S, p.shape[-1]) for p in parts],
                       [dy2[:, c - w : c] for c, w in zip(_ends(widths), widths, strict=True)], rotate, cos,
                       sin, S, head_dim, -1):
            return dy
    for p, c, w, rot in zip(parts, _ends(widths), widths, rotate, strict=True):
        if p is None:
            dy[..., c - w : c].zero_()
        else:
            _move(p, dy[..., c - w : c], rot, cos, sin, head_dim, -1)
    return dy


@split_rotate_backward.register_fake
def _(grads: Sequence[torch.Tensor | None], cos: torch.Tensor, sin: torch.Tensor, shape: Sequence[int],
      dtype: torch.dtype, widths: Sequence[int], rotate: Sequence[bool], head_dim: int) -> torch.Tensor:
    return cos.new_empty(list(shape), dtype=dtype)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: object) -> None:
    y, cos, sin, widths, rotate_, head_dim = inputs
    ctx.save_for_backward(cos, sin)
    ctx.shape, ctx.dtype = list(y.shape), y.dtype
    ctx.widths, ctx.rotate, ctx.head_dim = list(widths), list(rotate_), head_dim


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    cos, sin = ctx.saved_tensors
    dy = split_rotate_backward(list(grads), cos, sin, ctx.shape, ctx.dtype, ctx.widths, ctx.rotate,
                               ctx.head_dim)
    return dy, None, None, None, None, None


split_rotate.register_autograd(_backward, setup_context=_setup_context)
