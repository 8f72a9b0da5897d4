"""Gate combine: ``o = g_cmp*o_cmp + g_sel*o_sel + g_win*o_win`` and its gate gradient.

The three branch outputs live in one buffer ``o3 [B, S, HQ, 3, Dv]``. Backward needs only
``dg[row, x] = rowsum(do * o_x)`` (fp32): the branch kernels form ``gate * do`` and
``delta = gate * dg`` themselves, so no per-branch ``do`` copy is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops._triton import next_pow2


@triton.jit
def _combine_fwd_kernel(O3, G, OUT, N, DV: tl.constexpr, BDV: tl.constexpr, BR: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.arange(0, BDV)
    ok = rows < N
    m = ok[:, None] & (c[None, :] < DV)
    acc = tl.zeros([BR, BDV], tl.float32)
    for x in tl.static_range(3):
        gx = tl.load(G + rows * 3 + x, mask=ok, other=0.0).to(tl.float32)
        ox = tl.load(O3 + (rows[:, None] * 3 + x) * DV + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc += gx[:, None] * ox
    tl.store(OUT + rows[:, None] * DV + c[None, :], acc.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _combine_bwd_kernel(O3, DO, DG, N, DV: tl.constexpr, BDV: tl.constexpr, BR: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.arange(0, BDV)
    ok = rows < N
    m = ok[:, None] & (c[None, :] < DV)
    do = tl.load(DO + rows[:, None] * DV + c[None, :], mask=m, other=0.0).to(tl.float32)
    for x in tl.static_range(3):
        ox = tl.load(O3 + (rows[:, None] * 3 + x) * DV + c[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(DG + rows * 3 + x, tl.sum(do * ox, 1), mask=ok)


def _rows(dv: int) -> tuple[int, int]:
    bdv = max(16, next_pow2(dv))
    return bdv, max(1, 4096 // bdv)


def combine_fwd(o3: torch.Tensor, gates: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``o3 [B,S,HQ,3,Dv]``, contiguous ``gates [B,S,HQ,3]`` -> ``o [B,S,HQ,Dv]``."""
    B, S, HQ, _, DV = o3.shape
    out = torch.empty(B, S, HQ, DV, device=o3.device, dtype=out_dtype)
    n = B * S * HQ
    bdv, br = _rows(DV)
    _combine_fwd_kernel[(triton.cdiv(n, br),)](o3, gates, out, n, DV=DV, BDV=bdv, BR=br, num_warps=4)
    return out


def combine_bwd(o3: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """``dg [B,S,HQ,3]`` fp32, ``dg[..., x] = sum(do * o_x)``; ``do`` contiguous."""
    B, S, HQ, _, DV = o3.shape
    dg = torch.empty(B, S, HQ, 3, device=o3.device, dtype=torch.float32)
    n = B * S * HQ
    bdv, br = _rows(DV)
    _combine_bwd_kernel[(triton.cdiv(n, br),)](o3, do, dg, n, DV=DV, BDV=bdv, BR=br, num_warps=4)
    return dg
