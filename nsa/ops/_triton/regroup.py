"""Copies between the op's rows ``[B, S, HQ, D]`` and the compressed branch's virtual rows ``[B, HQ*d, N, D]``
(:mod:`nsa.ops.cmp_sdpa`) as one Triton pass each: a program moves ``BR`` consecutive virtual rows of one
``(batch, kv head, group head, r)``, each a contiguous ``D``-vector on both sides, computing the source row
from the geometry (PyTorch's strided copy of the 6-d view runs at about half the memory bandwidth).

Virtual row ``n`` offset ``r`` of query head ``hq`` holds row ``n*d + origin + r`` (``origin``:
:func:`nsa.ops.cmp_sdpa.geometry`); slots no row fills are written as zeros."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops._triton import next_pow2


@triton.jit
def _program_rows(S, N, origin, HQ: tl.constexpr, DD: tl.constexpr, BR: tl.constexpr):
    """This program's virtual head ``row`` = (b, hq, r) (hq = h*G + g: the virtual head order), its batch and
    query head, its ``BR`` virtual rows ``n``, their source rows ``t`` and which of them exist."""
    row = tl.program_id(1).to(tl.int64)
    b = row // (HQ * DD)
    hr = row % (HQ * DD)
    n = tl.program_id(0) * BR + tl.arange(0, BR)
    t = n.to(tl.int64) * DD + origin + hr % DD
    return row, b, hr // DD, n, t, (n < N) & (t >= 0) & (t < S)


@triton.jit
def _to_virtual_kernel(X, M, Y, OV, DG, sxb, sxs, sxh, smb, sms, smh, sob, soh, son, S, N, origin,
                       HQ: tl.constexpr, DD: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                       BR: tl.constexpr, MUL: tl.constexpr, DOT: tl.constexpr):
    row, b, hq, n, t, ok = _program_rows(S, N, origin, HQ, DD, BR)
    c = tl.arange(0, BD)
    x = tl.load(X + b * sxb + t[:, None] * sxs + hq * sxh + c[None, :], mask=ok[:, None] & (c[None, :] < D),
                other=0.0)
    if DOT:  # each row's dot product with the virtual tensor OV at its place: DG[b, t, hq, 0] ([B, S, HQ, 3])
        o = tl.load(OV + b * sob + (row % (HQ * DD)) * soh + n[:, None] * son + c[None, :],
                    mask=ok[:, None] & (c[None, :] < D), other=0.0)
        dot = tl.sum(x.to(tl.float32) * o.to(tl.float32), 1)
        tl.store(DG + ((b * S + t) * HQ + hq) * 3, dot, mask=ok)
    if MUL:
        m = tl.load(M + b * smb + t * sms + hq * smh, mask=ok, other=0.0)
        x = (x.to(tl.float32) * m.to(tl.float32)[:, None]).to(Y.dtype.element_ty)
    tl.store(Y + (row * N + n[:, None]) * D + c[None, :], x.to(Y.dtype.element_ty),
             mask=(n[:, None] < N) & (c[None, :] < D))


@triton.jit
def _to_rows_kernel(Y, X, sxb, sxs, sxh, S, N, origin,
                    HQ: tl.constexpr, DD: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    row, b, hq, n, t, ok = _program_rows(S, N, origin, HQ, DD, BR)
    c = tl.arange(0, BD)
    y = tl.load(Y + (row * N + n[:, None]) * D + c[None, :], mask=ok[:, None] & (c[None, :] < D), other=0.0)
    tl.store(X + b * sxb + t[:, None] * sxs + hq * sxh + c[None, :], y.to(X.dtype.element_ty),
             mask=ok[:, None] & (c[None, :] < D))


def _rows_per_program(D: int) -> int:
    return max(1, min(64, 8192 // next_pow2(D)))


def to_virtual(x: torch.Tensor, mul: torch.Tensor | None, d: int, origin: int, N: int,
               dot: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rows ``x [B, S, HQ, D]`` (``D`` contiguous; times ``mul [B, S, HQ, 1]`` when given) as a new
    ``[B, HQ*d, N, D]``. ``dot=(o_v, dg)``: also write each row's ``sum(x * o_v)`` (``o_v`` virtual, ``D``
    contiguous) into ``dg[..., 0]`` (``dg [B, S, HQ, 3]`` contiguous; rows no virtual row holds untouched)."""
    B, S, HQ, D = x.shape
    y = x.new_empty(B, HQ * d, N, D)
    if y.numel() == 0:
        return y
    br = _rows_per_program(D)
    m = mul if mul is not None else x
    ms = (m.stride(0), m.stride(1), m.stride(2)) if mul is not None else (0, 0, 0)
    o, dg = dot if dot is not None else (x, y)
    os_ = (o.stride(0), o.stride(1), o.stride(2)) if dot is not None else (0, 0, 0)
    _to_virtual_kernel[(triton.cdiv(N, br), B * HQ * d)](
        x, m, y, o, dg, x.stride(0), x.stride(1), x.stride(2), *ms, *os_, S, N, origin, HQ=HQ, DD=d, D=D,
        BD=max(16, next_pow2(D)), BR=br, MUL=mul is not None, DOT=dot is not None, num_warps=4)
    return y


def to_rows(y: torch.Tensor, x: torch.Tensor, d: int, origin: int) -> None:
    """Write ``y [B, HQ*d, N, D]`` into the rows of ``x [B, S, HQ, D]`` (``D`` contiguous) its virtual rows
    hold."""
    B, S, HQ, D = x.shape
    N = y.shape[2]
    if y.numel() == 0:
        return
    br = _rows_per_program(D)
    _to_rows_kernel[(triton.cdiv(N, br), B * HQ * d)](
        y.contiguous(), x, x.stride(0), x.stride(1), x.stride(2), S, N, origin, HQ=HQ, DD=d, D=D,
        BD=max(16, next_pow2(D)), BR=br, num_warps=4)
