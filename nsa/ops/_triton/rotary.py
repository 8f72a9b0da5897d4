"""One column range of a projection ``[rows, N]`` moved to or from a tensor of its own, rotated (RoPE, rotate-half
layout, per head of ``D`` columns) or copied, as one Triton pass (:mod:`nsa.ops.rotary`).

A program moves ``BR`` rows of one head (rotated: the two halves of each head, the angle table read once per row)
or of ``BC`` columns (copied). ``SIGN = -1`` rotates by minus the angle: the backward of a rotation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops._triton import next_pow2


@triton.jit
def _rotate_kernel(SRC, DST, COS, SIN, s_src, s_dst, rows, S, cos_batch,
                   HALF: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, SIGN: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    head = tl.program_id(1)
    j = tl.arange(0, BH)
    ok = (r < rows)[:, None] & (j < HALF)[None, :]
    r64 = r.to(tl.int64)
    t = (r64 // S) * cos_batch + r64 % S  # the angle table's row: [batch or 1, S, HALF]
    c = tl.load(COS + t[:, None] * HALF + j[None, :], mask=ok, other=0.0)
    s = tl.load(SIN + t[:, None] * HALF + j[None, :], mask=ok, other=0.0) * SIGN
    src = SRC + r64[:, None] * s_src + head * (2 * HALF) + j[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = DST + r64[:, None] * s_dst + head * (2 * HALF) + j[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(DST.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (x1 * s + x2 * c).to(DST.dtype.element_ty), mask=ok)


@triton.jit
def _copy_kernel(SRC, DST, s_src, s_dst, rows, width, BR: tl.constexpr, BC: tl.constexpr):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = (r < rows)[:, None] & (c < width)[None, :]
    x = tl.load(SRC + r[:, None] * s_src + c[None, :], mask=ok, other=0.0)
    tl.store(DST + r[:, None] * s_dst + c[None, :], x.to(DST.dtype.element_ty), mask=ok)


def move(src: torch.Tensor, dst: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
         S: int, head_dim: int, sign: int = 1) -> None:
    """``dst[r, :] = rotate(src[r, :])`` (``cos``/``sin`` ``[1|B, S, head_dim/2]`` contiguous, float32; row ``r`` is
    position ``r % S`` of batch row ``r // S``), or a copy when ``cos`` is None. ``src``/``dst``: ``[rows, width]``
    with contiguous columns (any row stride), ``width`` a multiple of ``head_dim`` when rotating."""
    rows, width = src.shape
    if rows == 0 or width == 0:
        return
    if cos is None:
        bc = min(128, next_pow2(width))
        br = max(1, 4096 // bc)
        _copy_kernel[(triton.cdiv(rows, br), triton.cdiv(width, bc))](
            src, dst, src.stride(0), dst.stride(0), rows, width, BR=br, BC=bc, num_warps=4)
        return
    assert sin is not None
    half = head_dim // 2
    bh = next_pow2(half)
    br = max(1, 2048 // bh)
    _rotate_kernel[(triton.cdiv(rows, br), width // head_dim)](
        src, dst, cos, sin, src.stride(0), dst.stride(0), rows, S, S if cos.shape[0] > 1 else 0,
        HALF=half, BH=bh, BR=br, SIGN=sign, num_warps=4,
        enable_fp_fusion=False)  # a product and a difference rounded apart, as PyTorch's rotation does (no FMA)
