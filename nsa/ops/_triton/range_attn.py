"""Attention over a per-query key *range*: the compressed and the sliding-window branches.

Key ``j`` is visible to the query at position ``t`` iff ``j * STRIDE + OFF <= t`` and, for a window
(``WIN > 0``), ``t - j < WIN``. Compressed branch: ``STRIDE = d``, ``OFF = l - 1``, ``WIN = 0``; window
branch: ``STRIDE = 1``, ``OFF = 0``, ``WIN = w``. Query row ``i`` sits at position ``t = Q0 + i``
(queries at an offset, a runtime integer; 0 for a whole sequence) and keys count from position 0.
Rows with no visible key give zeros and ``lse = +inf`` (so a recomputed probability is exactly 0).
``lse`` is kept in the log2 domain.

Forward: ``range_fwd`` (o, lse). Backward: ``range_bwd_dq`` (adds into dq, summed in fp32) and
``range_bwd_dkdv`` (one program per key tile and group, looping over the query rows that see it).
The branch output gradient is ``gate * do``, formed inside the kernels; ``delta = gate * dg`` where
``dg = rowsum(do * o_branch)`` comes from the combine backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops._triton import is_tuned, next_pow2, sm_count, tile_config, tuned

LOG2E = 1.4426950408889634


@triton.jit
def _range_fwd_kernel(
    Q, K, V, OUT, LSE, GATE, FINAL, OC,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, scb, scs, sch,
    S, NK, HQ, Q0, scale_log2,
    HG: tl.constexpr, H: tl.constexpr, STRIDE: tl.constexpr, OFF: tl.constexpr, WIN: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, WRITE_O: tl.constexpr, COMBINE: tl.constexpr,
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
    pos64 = pos.to(tl.int64)
    q = tl.load(Q + b * sqb + pos64[:, None] * sqs + head[:, None] * sqh + ck[None, :],
                mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
    apos = Q0 + pos  # absolute positions of the rows (queries at an offset)
    t_last = Q0 + tl.minimum(t0 + BT - 1, S - 1)
    j_hi = tl.where(t_last >= OFF, (t_last - OFF) // STRIDE + 1, 0)
    j_hi = tl.minimum(j_hi, NK)
    if WIN > 0:
        j_lo = tl.maximum(Q0 + t0 - WIN + 1, 0)
    else:
        j_lo = 0
    j_start = (j_lo // BN) * BN
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    for j0 in range(j_start, j_hi, BN):
        j = j0 + tl.arange(0, BN)
        j64 = j.to(tl.int64)
        kmask = j < j_hi
        k = tl.load(K + b * skb + j64[:, None] * sks + g * skh + ck[None, :],
                    mask=kmask[:, None] & (ck[None, :] < DK), other=0.0)
        s = (tl.dot(q, tl.trans(k)) * scale_log2).to(tl.float32)
        vis = (j[None, :] * STRIDE + OFF <= apos[:, None]) & kmask[None, :]
        if WIN > 0:
            vis = vis & (apos[:, None] - j[None, :] < WIN)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * svb + j64[:, None] * svs + g * svh + cv[None, :],
                    mask=kmask[:, None] & (cv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0.0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(LSE + (b * S + pos64) * HQ + head, lse, mask=row_ok)
    if WRITE_O:
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        optr = OUT + b * sob + pos64[:, None] * sos + head[:, None] * soh + cv[None, :]
        omask = row_ok[:, None] & (cv[None, :] < DV)
        tl.store(optr, o.to(OUT.dtype.element_ty), mask=omask)
        if COMBINE:
            # OUT is the last slot of o3 [B, S, HQ, slots, Dv], the selected branch's output the one before;
            # the compressed branch's output comes through OC (o3's first slot, or rows of its own)
            row = (b * S + pos64) * HQ + head
            fin = o * tl.load(GATE + row * 3 + 2, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            o1 = tl.load(optr - DV, mask=omask, other=0.0).to(tl.float32)
            fin += o1 * tl.load(GATE + row * 3 + 1, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            o0 = tl.load(OC + b * scb + pos64[:, None] * scs + head[:, None] * sch + cv[None, :], mask=omask,
                         other=0.0).to(tl.float32)
            fin += o0 * tl.load(GATE + row * 3, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(FINAL + row[:, None] * DV + cv[None, :], fin.to(FINAL.dtype.element_ty), mask=omask)


@triton.jit
def _range_bwd_dq_kernel(
    Q, K, V, DO, LSE, GATE, DG, DQ, O3, DQO,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    S, NK, HQ, Q0, scale_log2, scale,
    HG: tl.constexpr, H: tl.constexpr, STRIDE: tl.constexpr, OFF: tl.constexpr, WIN: tl.constexpr,
    X: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, ACCUM: tl.constexpr, DG_FROM_O3: tl.constexpr,
    CAST_OUT: tl.constexpr, NSLOT: tl.constexpr,
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
    pos64 = pos.to(tl.int64)
    row = (b * S + pos64) * HQ + head
    q = tl.load(Q + b * sqb + pos64[:, None] * sqs + head[:, None] * sqh + ck[None, :],
                mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
    gate = tl.load(GATE + row * 3 + X, mask=row_ok, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + pos64[:, None] * sds + head[:, None] * sdh + cv[None, :],
                 mask=row_ok[:, None] & (cv[None, :] < DV), other=0.0)
    if DG_FROM_O3:
        # the gate gradient of all three branches, dg[row, x] = sum(do * o_x), written for the kernels after
        omask = row_ok[:, None] & (cv[None, :] < DV)
        dof = do.to(tl.float32)
        # (o3 holds the selected and window outputs in its last two slots; with NSLOT == 2 the compressed
        # branch's gate gradient is written later, from its own output)
        o3p = O3 + row[:, None] * NSLOT * DV + cv[None, :]
        if NSLOT == 3:
            dg0 = tl.sum(dof * tl.load(o3p, mask=omask, other=0.0).to(tl.float32), 1)
            tl.store(DG + row * 3, dg0, mask=row_ok)
        dg1 = tl.sum(dof * tl.load(o3p + (NSLOT - 2) * DV, mask=omask, other=0.0).to(tl.float32), 1)
        dg2 = tl.sum(dof * tl.load(o3p + (NSLOT - 1) * DV, mask=omask, other=0.0).to(tl.float32), 1)
        tl.store(DG + row * 3 + 1, dg1, mask=row_ok)
        tl.store(DG + row * 3 + 2, dg2, mask=row_ok)
        if X == 0:
            delta = gate * dg0
        elif X == 1:
            delta = gate * dg1
        else:
            delta = gate * dg2
    else:
        delta = gate * tl.load(DG + row * 3 + X, mask=row_ok, other=0.0)
    do = (do.to(tl.float32) * gate[:, None]).to(q.dtype)
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    apos = Q0 + pos  # absolute positions of the rows (queries at an offset)
    t_last = Q0 + tl.minimum(t0 + BT - 1, S - 1)
    j_hi = tl.where(t_last >= OFF, (t_last - OFF) // STRIDE + 1, 0)
    j_hi = tl.minimum(j_hi, NK)
    if WIN > 0:
        j_lo = tl.maximum(Q0 + t0 - WIN + 1, 0)
    else:
        j_lo = 0
    j_start = (j_lo // BN) * BN
    dq = tl.zeros([BM, BDK], tl.float32)
    for j0 in range(j_start, j_hi, BN):
        j = j0 + tl.arange(0, BN)
        j64 = j.to(tl.int64)
        kmask = j < j_hi
        k = tl.load(K + b * skb + j64[:, None] * sks + g * skh + ck[None, :],
                    mask=kmask[:, None] & (ck[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + j64[:, None] * svs + g * svh + cv[None, :],
                    mask=kmask[:, None] & (cv[None, :] < DV), other=0.0)
        s = (tl.dot(q, tl.trans(k)) * scale_log2).to(tl.float32)
        vis = (j[None, :] * STRIDE + OFF <= apos[:, None]) & kmask[None, :]
        if WIN > 0:
            vis = vis & (apos[:, None] - j[None, :] < WIN)
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    dq = (dq * scale).to(tl.float32)
    ptrs = DQ + (b * S + pos64[:, None]) * HQ * DK + head[:, None] * DK + ck[None, :]
    msk = row_ok[:, None] & (ck[None, :] < DK)
    if ACCUM:
        dq += tl.load(ptrs, mask=msk, other=0.0).to(tl.float32)
    if CAST_OUT:
        tl.store(DQO + (b * S + pos64[:, None]) * HQ * DK + head[:, None] * DK + ck[None, :],
                 dq.to(DQO.dtype.element_ty), mask=msk)
    else:
        tl.store(ptrs, dq.to(DQ.dtype.element_ty), mask=msk)


@triton.jit
def _range_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, GATE, DG, DK_, DV_,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    S, NK, HQ, Q0, QCH, scale_log2, scale,
    HG: tl.constexpr, H: tl.constexpr, STRIDE: tl.constexpr, OFF: tl.constexpr, WIN: tl.constexpr,
    X: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, ATOMIC: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    chunk = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    g = bh % H
    BT: tl.constexpr = BM // HG
    j0 = pid * BN
    j = j0 + tl.arange(0, BN)
    j64 = j.to(tl.int64)
    kmask = j < NK
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    k = tl.load(K + b * skb + j64[:, None] * sks + g * skh + ck[None, :],
                mask=kmask[:, None] & (ck[None, :] < DK), other=0.0)
    v = tl.load(V + b * svb + j64[:, None] * svs + g * svh + cv[None, :],
                mask=kmask[:, None] & (cv[None, :] < DV), other=0.0)
    # query rows (row i at position Q0 + i) that can see a key of this tile
    t_min = tl.maximum(j0 * STRIDE + OFF - Q0, chunk * QCH)
    if WIN > 0:
        t_max = tl.minimum(S, j0 + BN - 1 + WIN - Q0)
    else:
        t_max = S
    t_max = tl.minimum(t_max, chunk * QCH + QCH)
    dk = tl.zeros([BN, BDK], tl.float32)
    dv = tl.zeros([BN, BDV], tl.float32)
    r = tl.arange(0, BM)
    for p0 in range(t_min, t_max, BT):
        pos = p0 + r // HG
        head = g * HG + r % HG
        row_ok = (r < BT * HG) & (pos < t_max)
        pos64 = pos.to(tl.int64)
        row = (b * S + pos64) * HQ + head
        q = tl.load(Q + b * sqb + pos64[:, None] * sqs + head[:, None] * sqh + ck[None, :],
                    mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
        do = tl.load(DO + b * sdb + pos64[:, None] * sds + head[:, None] * sdh + cv[None, :],
                     mask=row_ok[:, None] & (cv[None, :] < DV), other=0.0)
        gate = tl.load(GATE + row * 3 + X, mask=row_ok, other=0.0).to(tl.float32)
        delta = gate * tl.load(DG + row * 3 + X, mask=row_ok, other=0.0)
        lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
        s = (tl.dot(q, tl.trans(k)) * scale_log2).to(tl.float32)
        apos = Q0 + pos
        vis = (j[None, :] * STRIDE + OFF <= apos[:, None]) & kmask[None, :] & row_ok[:, None]
        if WIN > 0:
            vis = vis & (apos[:, None] - j[None, :] < WIN)
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        # the branch's gate scales the products' fp32 results, never the loaded do tile (scaling an
        # operand tile before its product costs a layout change per tile: 13% of the window's backward
        # at the paper shape; a gated do computed beforehand measured 4% slower, docs/kernels.md)
        dv += tl.dot(tl.trans((p * gate[:, None]).to(do.dtype)), do)
        dp = tl.dot(do, tl.trans(v)) * gate[:, None]
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    dk = (dk * scale).to(tl.float32)
    dk_ptr = DK_ + (b * NK + j64[:, None]) * H * DK + g * DK + ck[None, :]
    dv_ptr = DV_ + (b * NK + j64[:, None]) * H * DV + g * DV + cv[None, :]
    mk = kmask[:, None] & (ck[None, :] < DK)
    mv = kmask[:, None] & (cv[None, :] < DV)
    if ATOMIC:
        if t_min < t_max:
            tl.atomic_add(dk_ptr, dk, mask=mk)
            tl.atomic_add(dv_ptr, dv, mask=mv)
    else:
        tl.store(dk_ptr, dk.to(DK_.dtype.element_ty), mask=mk)
        tl.store(dv_ptr, dv.to(DV_.dtype.element_ty), mask=mv)


def _query_chunk(S: int, programs: int, device: torch.device) -> int:
    """Queries per dk/dv program of the compressed branch: at most 4096 (balances the triangle),
    and small enough that the grid holds about 4 programs per multiprocessor."""
    if is_tuned("cmp_qch"):
        return int(tuned("cmp_qch", 0))
    if device.type != "cuda":
        return 32
    sms = sm_count(device)
    chunks = max(triton.cdiv(S, 4096), triton.cdiv(4 * sms, programs))
    chunks = min(chunks, triton.cdiv(S, 256))
    return triton.cdiv(triton.cdiv(S, chunks), 64) * 64


def _kind(win: int) -> str:
    """Tile kind of a range call: the window branch (``win > 0``) or the compressed one."""
    return "win" if win > 0 else "cmp"


def _geom(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int, int]:
    B, S, HQ, DK = q.shape
    H = k.shape[2]
    return B, S, HQ, H, HQ // H, DK, v.shape[-1]


def range_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor | None, *,
    stride: int, off: int, win: int, scale: float,
    combine: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, q_start: int = 0,
) -> torch.Tensor:
    """Write the branch output into ``o`` (a ``[B,S,HQ,Dv]`` view; None: only lse); return lse.
    Query row ``i`` sits at position ``q_start + i``; ``k``/``v`` hold the keys from position 0.

    ``combine=(gates, out, o_cmp)``: ``o`` is the last slot of a contiguous ``o3 [B,S,HQ,slots,Dv]`` whose
    slot before it holds the selected branch's output, ``o_cmp`` (``[B,S,HQ,Dv]``, any strides) the
    compressed one's; also write the gated sum of the three into contiguous ``out`` (gates ``[B,S,HQ,3]``)."""
    B, S, HQ, H, h, DK, DV = _geom(q, k, v)
    NK = k.shape[1]
    cfg = tile_config(q.device, h, DK, DV, _kind(win))
    lse = torch.empty(B, S, HQ, device=q.device, dtype=torch.float32)
    out = o if o is not None else q  # dummy pointer when not writing
    gates, final, o_c = combine if combine is not None else (lse, lse, out)
    grid = (triton.cdiv(S, cfg.bm // h), B * H)
    _range_fwd_kernel[grid](
        q, k, v, out, lse, gates, final, o_c,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *o_c.stride()[:3],
        S, NK, HQ, q_start, scale * LOG2E,
        HG=h, H=H, STRIDE=stride, OFF=off, WIN=win, DK=DK, DV=DV,
        BDK=max(16, next_pow2(DK)), BDV=max(16, next_pow2(DV)), BM=cfg.bm, BN=cfg.bn,
        WRITE_O=o is not None, COMBINE=combine is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return lse


def range_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
    gates: torch.Tensor, dg: torch.Tensor, dq: torch.Tensor, *, branch: int, accum: bool,
    stride: int, off: int, win: int, scale: float, o3: torch.Tensor | None = None,
    dq_out: torch.Tensor | None = None, q_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add this branch's dq into ``dq`` (fp32, or q's dtype where one rounding more is fine; store when not
    ``accum``); return ``dk, dv`` (every key row; keys no query row sees get zeros). Query row ``i`` sits at
    position ``q_start + i``.

    ``o3 [B,S,HQ,slots,Dv]``: compute the gate gradient ``dg`` of the branches it holds from it first (``dg``
    is written; two slots: the selected and window branches only);
    ``dq_out``: write the final dq there (its dtype) instead of back into ``dq``."""
    B, S, HQ, H, h, DK, DV = _geom(q, k, v)
    NK = k.shape[1]
    common = dict(HG=h, H=H, STRIDE=stride, OFF=off, WIN=win, X=branch, DK=DK, DV=DV,
                  BDK=max(16, next_pow2(DK)), BDV=max(16, next_pow2(DV)))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    cfg = tile_config(q.device, h, DK, DV, _kind(win) + "dq")
    _range_bwd_dq_kernel[(triton.cdiv(S, cfg.bm // h), B * H)](
        q, k, v, do, lse, gates, dg, dq, o3 if o3 is not None else dq, dq_out if dq_out is not None else dq,
        *strides, S, NK, HQ, q_start, scale * LOG2E, scale, ACCUM=accum, DG_FROM_O3=o3 is not None,
        CAST_OUT=dq_out is not None, NSLOT=o3.shape[3] if o3 is not None else 3, BM=cfg.bm, BN=cfg.bn,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
    )
    cfg = tile_config(q.device, h, DK, DV, _kind(win) + "dkdv")
    # long query ranges (compressed branch) are split over programs that add dk/dv atomically
    qch = S if win > 0 else _query_chunk(S, triton.cdiv(max(NK, 1), cfg.bn) * B * H, q.device)
    n_chunks = triton.cdiv(S, qch)
    atomic = n_chunks > 1
    if atomic:
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    else:
        dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)  # contiguous, whatever k's strides
        dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    if NK > 0:
        _range_bwd_dkdv_kernel[(triton.cdiv(NK, cfg.bn), B * H, n_chunks)](
            q, k, v, do, lse, gates, dg, dk, dv, *strides, S, NK, HQ, q_start, qch, scale * LOG2E, scale,
            ATOMIC=atomic, BM=cfg.bm, BN=cfg.bn, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )
    return dk.to(k.dtype), dv.to(v.dtype)
