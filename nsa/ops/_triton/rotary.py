"""Column ranges of a projection ``[rows, N]`` moved to or from tensors of their own, rotated (RoPE,
rotate-half layout, per head of ``D`` columns) or copied, by Triton (:mod:`nsa.ops.rotary`).

:func:`move` moves one range, :func:`move_parts` every part of a split in one launch (the parts' tensors given
as a tuple; a program's tile says which part it serves), so a layer's split and its backward cost one launch
each instead of one per part. A program moves ``BR`` rows of one head (rotated: the two halves of each head,
the angle table read once per row) or of ``BC`` columns (copied). ``SIGN = -1`` rotates by minus the angle:
the backward of a rotation."""

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


@triton.jit
def _parts_kernel(SRCS, DSTS, S_SRC, S_DST, COS, SIN, rows, S, cos_batch,
                  TSTART: tl.constexpr, ROT: tl.constexpr, ZERO: tl.constexpr, WID: tl.constexpr,
                  NP: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
                  SIGN: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    t = tl.program_id(1)
    r64 = r.to(tl.int64)
    live = r < rows
    for i in tl.static_range(NP):
        if (t >= TSTART[i]) & (t < TSTART[i + 1]):
            tile = t - TSTART[i]
            if ROT[i]:
                j = tl.arange(0, BH)
                ok = live[:, None] & (j < HALF)[None, :]
                dst = DSTS[i] + r64[:, None] * S_DST[i] + tile * (2 * HALF) + j[None, :]
                if ZERO[i]:
                    tl.store(dst, tl.zeros([BR, BH], dtype=DSTS[i].dtype.element_ty), mask=ok)
                    tl.store(dst + HALF, tl.zeros([BR, BH], dtype=DSTS[i].dtype.element_ty), mask=ok)
                else:
                    row = (r64 // S) * cos_batch + r64 % S  # the angle table's row: [batch or 1, S, HALF]
                    c = tl.load(COS + row[:, None] * HALF + j[None, :], mask=ok, other=0.0)
                    s = tl.load(SIN + row[:, None] * HALF + j[None, :], mask=ok, other=0.0) * SIGN
                    src = SRCS[i] + r64[:, None] * S_SRC[i] + tile * (2 * HALF) + j[None, :]
                    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
                    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
                    tl.store(dst, (x1 * c - x2 * s).to(DSTS[i].dtype.element_ty), mask=ok)
                    tl.store(dst + HALF, (x1 * s + x2 * c).to(DSTS[i].dtype.element_ty), mask=ok)
            else:
                col = tile * BC + tl.arange(0, BC)
                ok = live[:, None] & (col < WID[i])[None, :]
                dst = DSTS[i] + r64[:, None] * S_DST[i] + col[None, :]
                if ZERO[i]:
                    tl.store(dst, tl.zeros([BR, BC], dtype=DSTS[i].dtype.element_ty), mask=ok)
                else:
                    x = tl.load(SRCS[i] + r64[:, None] * S_SRC[i] + col[None, :], mask=ok, other=0.0)
                    tl.store(dst, x.to(DSTS[i].dtype.element_ty), mask=ok)


def move_parts(srcs: list[torch.Tensor | None], dsts: list[torch.Tensor], rotate: list[bool],
               cos: torch.Tensor, sin: torch.Tensor, S: int, head_dim: int, sign: int = 1) -> None:
    """:func:`move` for every part at once (one launch): ``dsts[i] = rotate(srcs[i])`` or a copy, zeros where
    ``srcs[i]`` is None. Each ``[rows, width_i]`` with contiguous columns (any row stride)."""
    rows = dsts[0].shape[0]
    if rows == 0:
        return
    half = head_dim // 2
    bh, bc, br = next_pow2(half), 128, 32
    widths = [d.shape[1] for d in dsts]
    tiles = [w // head_dim if rot else triton.cdiv(w, bc) for w, rot in zip(widths, rotate, strict=True)]
    starts = [0]
    for n in tiles:
        starts.append(starts[-1] + n)
    src = [d if x is None else x for x, d in zip(srcs, dsts, strict=True)]  # a zero part reads nothing
    _parts_kernel[(triton.cdiv(rows, br), starts[-1])](
        tuple(src), tuple(dsts), tuple(x.stride(0) for x in src), tuple(d.stride(0) for d in dsts), cos, sin,
                                                       rows,
        S, S if cos.shape[0] > 1 else 0, TSTART=tuple(starts), ROT=tuple(bool(x) for x in rotate),
        ZERO=tuple(x is None for x in srcs), WID=tuple(widths), NP=len(dsts), HALF=half, BH=bh, BC=bc, BR=br,
        SIGN=sign, num_warps=4,
        # a product and a difference rounded apart, as PyTorch's rotation does (no FMA)
        enable_fp_fusion=False)


def move(src: torch.Tensor, dst: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
         S: int, head_dim: int, sign: int = 1) -> None:
    """``dst[r, :] = rotate(src[r, :])`` (``cos``/``sin`` ``[1|B, S, head_dim/2]`` contiguous, float32; row
    ``r`` is position ``r % S`` of batch row ``r // S``), or a copy when ``cos`` is None. ``src``/``dst``:
    ``[rows, width]`` with contiguous columns (any row stride), ``width`` a multiple of ``head_dim`` when
    rotating."""
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
        # a product and a difference rounded apart, as PyTorch's rotation does (no FMA)
        enable_fp_fusion=False)
