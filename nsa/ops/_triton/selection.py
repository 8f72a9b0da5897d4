"""Selected-branch attention for any group size ``h``.

Forward and dq: a tile packs ``BM // h`` consecutive positions times the ``h`` heads of one group. The
tile walks the union of its positions' block lists, each distinct block once (a block already listed
by an earlier position of the tile is skipped); rows whose position did not choose a block are masked
out of it. Adjacent positions mostly choose the same blocks, so the union stays close to ``n_sel``.

dk/dv (the FSA order): the ``(position, block)`` pairs are sorted by block on the device (no host
sync), and one program takes a chunk of up to ``CH`` positions that chose one key block, gathering
their ``h`` query heads as rows. A block chosen by more than ``CH`` positions (block 0 always is) is
split over several programs that add into an fp32 buffer atomically; other blocks store directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops._triton import next_pow2, tile_config
from nsa.ops._triton.range_attn import LOG2E


@triton.jit
def _sel_fwd_kernel(
    Q, K, V, IDX, UL, UCNT, OUT, LSE,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    S, HQ, NT, U, scale_log2,
    HG: tl.constexpr, H: tl.constexpr, LS: tl.constexpr, BLS: tl.constexpr, N_SEL: tl.constexpr,
    NSP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    g = bh % H
    BT: tl.constexpr = BM // HG
    t0 = pid * BT
    r = tl.arange(0, BM)
    pos = t0 + r // HG
    head = g * HG + r % HG
    row_ok = (r < BT * HG) & (pos < S)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ns = tl.arange(0, NSP)
    kb = tl.arange(0, BLS)
    pos64 = pos.to(tl.int64)
    q = tl.load(Q + b * sqb + pos64[:, None] * sqs + head[:, None] * sqh + ck[None, :],
                mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
    idx_rows = tl.load(IDX + ((b * S + pos64[:, None]) * H + g) * N_SEL + ns[None, :],
                       mask=row_ok[:, None] & (ns[None, :] < N_SEL), other=-1)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    tile = bh.to(tl.int64) * NT + pid
    cnt = tl.load(UCNT + tile)
    for u in range(0, cnt):
        blk = tl.load(UL + tile * U + u)
        mine = tl.sum(tl.where(idx_rows == blk, 1, 0), 1) > 0
        kpos = blk * LS + kb
        kpos64 = kpos.to(tl.int64)
        kmask = (kb < LS) & (kpos < S)
        k = tl.load(K + b * skb + kpos64[:, None] * sks + g * skh + ck[None, :],
                    mask=kmask[:, None] & (ck[None, :] < DK), other=0.0)
        s = (tl.dot(q, tl.trans(k)) * scale_log2).to(tl.float32)
        vis = mine[:, None] & kmask[None, :] & (kpos[None, :] <= pos[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * svb + kpos64[:, None] * svs + g * svh + cv[None, :],
                    mask=kmask[:, None] & (cv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0.0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(LSE + (b * S + pos64) * HQ + head, lse, mask=row_ok)
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(OUT + b * sob + pos64[:, None] * sos + head[:, None] * soh + cv[None, :],
             o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (cv[None, :] < DV))


@triton.jit
def _sel_bwd_dq_kernel(
    Q, K, V, DO, IDX, UL, UCNT, LSE, GATE, DG, DQ,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    S, HQ, NT, U, scale_log2, scale,
    HG: tl.constexpr, H: tl.constexpr, LS: tl.constexpr, BLS: tl.constexpr, N_SEL: tl.constexpr,
    NSP: tl.constexpr, X: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
    BDV: tl.constexpr, BM: tl.constexpr, ACCUM: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    g = bh % H
    BT: tl.constexpr = BM // HG
    t0 = pid * BT
    r = tl.arange(0, BM)
    pos = t0 + r // HG
    head = g * HG + r % HG
    row_ok = (r < BT * HG) & (pos < S)
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    ns = tl.arange(0, NSP)
    kb = tl.arange(0, BLS)
    pos64 = pos.to(tl.int64)
    row = (b * S + pos64) * HQ + head
    q = tl.load(Q + b * sqb + pos64[:, None] * sqs + head[:, None] * sqh + ck[None, :],
                mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
    gate = tl.load(GATE + row * 3 + X, mask=row_ok, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + pos64[:, None] * sds + head[:, None] * sdh + cv[None, :],
                 mask=row_ok[:, None] & (cv[None, :] < DV), other=0.0)
    do = (do.to(tl.float32) * gate[:, None]).to(q.dtype)
    delta = gate * tl.load(DG + row * 3 + X, mask=row_ok, other=0.0)
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    idx_rows = tl.load(IDX + ((b * S + pos64[:, None]) * H + g) * N_SEL + ns[None, :],
                       mask=row_ok[:, None] & (ns[None, :] < N_SEL), other=-1)
    dq = tl.zeros([BM, BDK], tl.float32)
    tile = bh.to(tl.int64) * NT + pid
    cnt = tl.load(UCNT + tile)
    for u in range(0, cnt):
        blk = tl.load(UL + tile * U + u)
        mine = tl.sum(tl.where(idx_rows == blk, 1, 0), 1) > 0
        kpos = blk * LS + kb
        kpos64 = kpos.to(tl.int64)
        kmask = (kb < LS) & (kpos < S)
        k = tl.load(K + b * skb + kpos64[:, None] * sks + g * skh + ck[None, :],
                    mask=kmask[:, None] & (ck[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + kpos64[:, None] * svs + g * svh + cv[None, :],
                    mask=kmask[:, None] & (cv[None, :] < DV), other=0.0)
        s = (tl.dot(q, tl.trans(k)) * scale_log2).to(tl.float32)
        vis = mine[:, None] & kmask[None, :] & (kpos[None, :] <= pos[:, None])
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    dq = (dq * scale).to(tl.float32)
    ptrs = DQ + (b * S + pos64[:, None]) * HQ * DK + head[:, None] * DK + ck[None, :]
    msk = row_ok[:, None] & (ck[None, :] < DK)
    if ACCUM:
        dq += tl.load(ptrs, mask=msk, other=0.0)
    tl.store(ptrs, dq, mask=msk)


@triton.jit
def _sel_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, GATE, DG, DK_, DV_,
    WBLK, WCHK, STARTS, COUNTS, NCH, POS,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    S, HQ, NB, NW, NPAIR, scale_log2, scale,
    HG: tl.constexpr, H: tl.constexpr, LS: tl.constexpr, BLS: tl.constexpr, CH: tl.constexpr,
    X: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr,
):
    w = tl.program_id(0)
    bh = tl.program_id(1)
    blk = tl.load(WBLK + bh * NW + w)
    if blk < NB:
        b = (bh // H).to(tl.int64)
        g = bh % H
        BT: tl.constexpr = BM // HG
        chunk = tl.load(WCHK + bh * NW + w)
        start = tl.load(STARTS + bh * NB + blk) + chunk * CH
        end = tl.minimum(tl.load(STARTS + bh * NB + blk) + tl.load(COUNTS + bh * NB + blk), start + CH)
        single = tl.load(NCH + bh * NB + blk) == 1
        kb = tl.arange(0, BLS)
        kpos = blk * LS + kb
        kpos64 = kpos.to(tl.int64)
        kmask = (kb < LS) & (kpos < S)
        ck = tl.arange(0, BDK)
        cv = tl.arange(0, BDV)
        k = tl.load(K + b * skb + kpos64[:, None] * sks + g * skh + ck[None, :],
                    mask=kmask[:, None] & (ck[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + kpos64[:, None] * svs + g * svh + cv[None, :],
                    mask=kmask[:, None] & (cv[None, :] < DV), other=0.0)
        dk = tl.zeros([BLS, BDK], tl.float32)
        dv = tl.zeros([BLS, BDV], tl.float32)
        r = tl.arange(0, BM)
        for e0 in range(start, end, BT):
            e = e0 + r // HG
            row_ok = (r < BT * HG) & (e < end)
            pos = tl.load(POS + bh.to(tl.int64) * NPAIR + e, mask=row_ok, other=0)
            head = g * HG + r % HG
            pos64 = pos.to(tl.int64)
            row = (b * S + pos64) * HQ + head
            q = tl.load(Q + b * sqb + pos64[:, None] * sqs + head[:, None] * sqh + ck[None, :],
                        mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
            gate = tl.load(GATE + row * 3 + X, mask=row_ok, other=0.0).to(tl.float32)
            do = tl.load(DO + b * sdb + pos64[:, None] * sds + head[:, None] * sdh + cv[None, :],
                         mask=row_ok[:, None] & (cv[None, :] < DV), other=0.0)
            do = (do.to(tl.float32) * gate[:, None]).to(q.dtype)
            delta = gate * tl.load(DG + row * 3 + X, mask=row_ok, other=0.0)
            lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
            s = (tl.dot(q, tl.trans(k)) * scale_log2).to(tl.float32)
            vis = row_ok[:, None] & kmask[None, :] & (kpos[None, :] <= pos[:, None])
            p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        dk = (dk * scale).to(tl.float32)
        dk_ptr = DK_ + (b * S + kpos64[:, None]) * H * DK + g * DK + ck[None, :]
        dv_ptr = DV_ + (b * S + kpos64[:, None]) * H * DV + g * DV + cv[None, :]
        mk = kmask[:, None] & (ck[None, :] < DK)
        mv = kmask[:, None] & (cv[None, :] < DV)
        if single:
            tl.store(dk_ptr, dk, mask=mk)
            tl.store(dv_ptr, dv, mask=mv)
        else:
            tl.atomic_add(dk_ptr, dk, mask=mk)
            tl.atomic_add(dv_ptr, dv, mask=mv)


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, l_sel: int, n_sel: int,
            kind: str = "sel") -> dict[str, int]:
    HQ, DK = q.shape[2], q.shape[3]
    H = k.shape[2]
    h = HQ // H
    DV = v.shape[-1]
    cfg = tile_config(q.device, h, DK, DV, kind)
    return dict(HG=h, H=H, LS=l_sel, BLS=max(16, next_pow2(l_sel)), DK=DK, DV=DV,
                BDK=max(16, next_pow2(DK)), BDV=max(16, next_pow2(DV)), BM=cfg.bm,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def sel_tile_positions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, l_sel: int, n_sel: int) -> int:
    """Positions per query tile of the selected forward (shapes only: also under fake tensors)."""
    c = _common(q, k, v, l_sel, n_sel)
    return int(c["BM"] // c["HG"])


def sel_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, o: torch.Tensor, *,
    l_sel: int, scale: float,
) -> tuple[torch.Tensor, tuple[int, torch.Tensor, torch.Tensor]]:
    """Write the selected branch into ``o`` (a ``[B,S,HQ,Dv]`` view); return its lse (log2) and the
    tiles' block lists ``(bt, ul, cnt)`` for reuse by the backward."""
    B, S, HQ, _ = q.shape
    H, n_sel = k.shape[2], idx.shape[-1]
    c = _common(q, k, v, l_sel, n_sel)
    lse = torch.empty(B, S, HQ, device=q.device, dtype=torch.float32)
    bt = sel_tile_positions(q, k, v, l_sel, n_sel)
    ul, cnt = tile_blocks(idx, bt)
    nt = triton.cdiv(S, bt)
    _sel_fwd_kernel[(nt, B * H)](
        q, k, v, idx, ul, cnt, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        S, HQ, nt, ul.shape[1], scale * LOG2E, N_SEL=n_sel, NSP=max(2, next_pow2(n_sel)), **c,
    )
    return lse, (bt, ul, cnt)


def tile_blocks(idx: torch.Tensor, bt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct blocks of each tile of ``bt`` positions (ascending, padded) and their count.

    ``idx [B, S, H, n]`` -> ``ul [B*H*T, bt*n]`` int32, ``cnt [B*H*T]`` int32 with ``T = ceil(S/bt)``.
    Device ops only (no host sync).
    """
    B, S, H, n = idx.shape
    T = -(-S // bt)
    x = idx.permute(0, 2, 1, 3)
    if T * bt != S:
        x = torch.nn.functional.pad(x, (0, 0, 0, T * bt - S), value=-1)
    big = torch.iinfo(torch.int32).max
    x = x.reshape(B * H * T, bt * n)
    x = torch.where(x < 0, torch.full_like(x, big), x)
    xs = torch.sort(x, dim=1).values
    first = torch.ones_like(xs, dtype=torch.bool)
    first[:, 1:] = xs[:, 1:] != xs[:, :-1]
    first &= xs != big
    ul = torch.sort(torch.where(first, xs, torch.full_like(xs, big)), dim=1).values
    return ul.to(torch.int32).contiguous(), first.sum(1).to(torch.int32).contiguous()


def _work_list(idx: torch.Tensor, S: int, l_sel: int, ch: int) -> tuple[tuple[torch.Tensor, ...], int]:
    """Positions sorted by chosen block, and (block, chunk) work items; device ops only."""
    B, _, H, n_sel = idx.shape
    NB = -(-S // l_sel)
    keys = idx.permute(0, 2, 1, 3).reshape(B * H, S * n_sel).long()
    keys = torch.where(keys < 0, torch.full_like(keys, NB), keys)
    _, perm = torch.sort(keys, dim=1, stable=True)
    pos = torch.div(perm, n_sel, rounding_mode="floor").to(torch.int32).contiguous()
    counts = torch.zeros(B * H, NB + 1, device=idx.device, dtype=torch.int64)
    counts.scatter_add_(1, keys, torch.ones_like(keys))
    counts = counts[:, :NB].contiguous()
    starts = (torch.cumsum(counts, 1) - counts).contiguous()
    nch = torch.div(counts + ch - 1, ch, rounding_mode="floor").contiguous()
    cum = torch.cumsum(nch, 1).contiguous()
    nw = NB + -(-(S * n_sel) // ch)
    wids = torch.arange(nw, device=idx.device, dtype=torch.int64).expand(B * H, nw).contiguous()
    wblk = torch.searchsorted(cum, wids, right=True)
    first = (cum - nch).gather(1, wblk.clamp(max=NB - 1))
    wchk = wids - first
    return (wblk.to(torch.int32).contiguous(), wchk.to(torch.int32).contiguous(),
            starts.to(torch.int32), counts.to(torch.int32), nch.to(torch.int32), pos), nw


def sel_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, do: torch.Tensor,
    lse: torch.Tensor, gates: torch.Tensor, dg: torch.Tensor, dq: torch.Tensor, *, branch: int,
    accum: bool, l_sel: int, scale: float, tiles: tuple[int, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the selected branch's dq into fp32 ``dq``; return fp32 ``dk, dv``."""
    B, S, HQ, _ = q.shape
    H, n_sel = k.shape[2], idx.shape[-1]
    c = _common(q, k, v, l_sel, n_sel, "seldq")
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    bt = c["BM"] // c["HG"]
    ul, cnt = tiles[1:] if tiles is not None and tiles[0] == bt else tile_blocks(idx, bt)
    nt = triton.cdiv(S, bt)
    _sel_bwd_dq_kernel[(nt, B * H)](
        q, k, v, do, idx, ul, cnt, lse, gates, dg, dq, *strides, S, HQ, nt, ul.shape[1], scale * LOG2E, scale,
        N_SEL=n_sel, NSP=max(2, next_pow2(n_sel)), X=branch, ACCUM=accum, **c,
    )
    c = _common(q, k, v, l_sel, n_sel, "seldkdv")
    ch = 512 if q.is_cuda else 32
    (wblk, wchk, starts, counts, nch, pos), nw = _work_list(idx, S, l_sel, ch)
    NB = -(-S // l_sel)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    _sel_bwd_dkdv_kernel[(nw, B * H)](
        q, k, v, do, lse, gates, dg, dk, dv, wblk, wchk, starts, counts, nch, pos, *strides,
        S, HQ, NB, nw, S * n_sel, scale * LOG2E, scale, CH=ch, X=branch, **c,
    )
    return dk, dv
