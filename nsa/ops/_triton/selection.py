"""Selected-branch attention in two loop orders, chosen per shape (:func:`sel_mode`).

``row`` (large groups, ``h >= 16`` by default): one program per position and group; its ``h`` query
heads are the rows (padded to 16) and it walks that position's own ``n_sel`` blocks, loading each
``[l_sel, D]`` key/value block with a TMA tensor descriptor on Hopper. No tile unions, no sorts in the
forward; dq the same way.

``fsa`` (small groups, the FSA order): the ``(position, slot)`` pairs are sorted by chosen block on the
device (:func:`work_list`, no host sync). One program takes one key block and a chunk of up to ``CH``
pairs that chose it, loads the block once and gathers the pairs' ``h`` heads as rows, so every product
is ``BM`` rows tall whatever ``h`` is. The forward writes one partial output and log-sum-exp per
``(row, slot)`` and a merge pass combines a row's ``n_sel`` partials.

dk/dv always run block by block on the sorted pairs (for ``row`` the list is built in the backward, in
larger chunks), in the *head order*: one program per (query head, work item), a tile being ``BM`` pairs of
that one head, the group's heads neighbouring programs that add into the same fp32 dk/dv rows
atomically. ``fsa`` mode computes each pair's dq partial in the same program (5 products) and a
reduction adds them up; ``row`` mode has its own per-position dq kernel.

Block lists must be canonical (:func:`canonical_blocks`): the valid blocks ascending and unique first,
``-1`` after; the top-n kernel writes them so, and given lists are made so once.

Queries at an offset: query row ``i`` sits at position ``Q0 + i`` of the ``SK`` keys (``S``: the query
rows); row buffers are indexed by row, key buffers by key, block numbers are absolute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops._triton import cc_major, interpreting, next_pow2, tile_config, tuned, worklist
from nsa.ops._triton.range_attn import LOG2E

try:  # Triton >= 3.4: host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None


# ---------------------------------------------------------------------------------------------------
# row order: one program per (position, group)

@triton.jit
def _load_block(K, k_desc, b, g, blk, kb, ck, skb, sks, skh, SK,
                LS: tl.constexpr, BLS: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        k = k_desc.load([b.to(tl.int32), blk * LS, g, 0]).reshape(BLS, BDK)
    else:
        kpos = (blk * LS + kb).to(tl.int64)
        k = tl.load(K + b * skb + kpos[:, None] * sks + g * skh + ck[None, :],
                    mask=(kb[:, None] < LS) & (kpos[:, None] < SK) & (ck[None, :] < DK), other=0.0)
    return k


@triton.jit
def _sel_fwd_row_kernel(
    Q, K, V, IDX, OUT, LSE, k_desc, v_desc,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    S, SK, HQ, Q0, scale_log2,
    HG: tl.constexpr, H: tl.constexpr, LS: tl.constexpr, BLS: tl.constexpr, N_SEL: tl.constexpr,
    NSP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    BH: tl.constexpr, TMA: tl.constexpr,
):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    g = bh % H
    r = tl.arange(0, BH)
    head = g * HG + r
    row_ok = r < HG
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    kb = tl.arange(0, BLS)
    ns = tl.arange(0, NSP)
    t64 = t.to(tl.int64)
    q = tl.load(Q + b * sqb + t64 * sqs + head[:, None] * sqh + ck[None, :],
                mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
    ibase = ((b * S + t64) * H + g) * N_SEL
    n_valid = tl.sum((tl.load(IDX + ibase + ns, mask=ns < N_SEL, other=-1) >= 0).to(tl.int32), 0)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BDV], tl.float32)
    for i in range(0, n_valid):
        blk = tl.load(IDX + ibase + i)
        k = _load_block(K, k_desc, b, g, blk, kb, ck, skb, sks, skh, SK, LS, BLS, DK, BDK, TMA)
        v = _load_block(V, v_desc, b, g, blk, kb, cv, svb, svs, svh, SK, LS, BLS, DV, BDV, TMA)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        vis = (blk * LS + kb <= Q0 + t) & (kb < LS)
        s = tl.where(vis[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0.0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(LSE + (b * S + t64) * HQ + head, lse, mask=row_ok)
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(OUT + b * sob + t64 * sos + head[:, None] * soh + cv[None, :],
             o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (cv[None, :] < DV))


@triton.jit
def _sel_dq_row_kernel(
    Q, K, V, DO, IDX, LSE, GATE, DG, DQ, k_desc, v_desc,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    S, SK, HQ, Q0, scale_log2, scale,
    HG: tl.constexpr, H: tl.constexpr, LS: tl.constexpr, BLS: tl.constexpr, N_SEL: tl.constexpr,
    NSP: tl.constexpr, X: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
    BDV: tl.constexpr, BH: tl.constexpr, TMA: tl.constexpr, ACCUM: tl.constexpr,
):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    g = bh % H
    r = tl.arange(0, BH)
    head = g * HG + r
    row_ok = r < HG
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    kb = tl.arange(0, BLS)
    ns = tl.arange(0, NSP)
    t64 = t.to(tl.int64)
    row = (b * S + t64) * HQ + head
    q = tl.load(Q + b * sqb + t64 * sqs + head[:, None] * sqh + ck[None, :],
                mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
    gate = tl.load(GATE + row * 3 + X, mask=row_ok, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + t64 * sds + head[:, None] * sdh + cv[None, :],
                 mask=row_ok[:, None] & (cv[None, :] < DV), other=0.0)
    do = (do.to(tl.float32) * gate[:, None]).to(q.dtype)
    delta = gate * tl.load(DG + row * 3 + X, mask=row_ok, other=0.0)
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    ibase = ((b * S + t64) * H + g) * N_SEL
    n_valid = tl.sum((tl.load(IDX + ibase + ns, mask=ns < N_SEL, other=-1) >= 0).to(tl.int32), 0)
    dq = tl.zeros([BH, BDK], tl.float32)
    for i in range(0, n_valid):
        blk = tl.load(IDX + ibase + i)
        k = _load_block(K, k_desc, b, g, blk, kb, ck, skb, sks, skh, SK, LS, BLS, DK, BDK, TMA)
        v = _load_block(V, v_desc, b, g, blk, kb, cv, svb, svs, svh, SK, LS, BLS, DV, BDV, TMA)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        vis = (blk * LS + kb <= Q0 + t) & (kb < LS)
        p = tl.where(vis[None, :], tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * scale
    ptrs = DQ + row[:, None] * DK + ck[None, :]
    msk = row_ok[:, None] & (ck[None, :] < DK)
    if ACCUM:
        dq += tl.load(ptrs, mask=msk, other=0.0).to(tl.float32)
    tl.store(ptrs, dq.to(DQ.dtype.element_ty), mask=msk)


# ---------------------------------------------------------------------------------------------------
# FSA order: one program per (key block, chunk of the pairs that chose it)

@triton.jit
def _sel_fsa_fwd_kernel(
    Q, K, V, WORK, OP, LP,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
    S, SK, HQ, Q0, NB, NW, WROW, SN, scale_log2,
    HG: tl.constexpr, H: tl.constexpr, LS: tl.constexpr, BLS: tl.constexpr, N_SEL: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr,
):
    w = tl.program_id(0)
    bh = tl.program_id(1)
    wbase = bh.to(tl.int64) * WROW
    blk = tl.load(WORK + wbase + SN + w * 3)
    if blk < NB:
        start = tl.load(WORK + wbase + SN + w * 3 + 1)
        end = tl.load(WORK + wbase + SN + w * 3 + 2)
        b = (bh // H).to(tl.int64)
        g = bh % H
        BT: tl.constexpr = BM // HG
        kb = tl.arange(0, BLS)
        kpos = blk * LS + kb
        kpos64 = kpos.to(tl.int64)
        kmask = (kb < LS) & (kpos < SK)
        ck = tl.arange(0, BDK)
        cv = tl.arange(0, BDV)
        k = tl.load(K + b * skb + kpos64[:, None] * sks + g * skh + ck[None, :],
                    mask=kmask[:, None] & (ck[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + kpos64[:, None] * svs + g * svh + cv[None, :],
                    mask=kmask[:, None] & (cv[None, :] < DV), other=0.0)
        r = tl.arange(0, BM)
        head = g * HG + r % HG
        for e0 in range(start, end, BT):
            e = e0 + r // HG
            row_ok = (r < BT * HG) & (e < end)
            f = tl.load(WORK + wbase + e, mask=row_ok, other=0)
            pos = f // N_SEL
            slot = f - pos * N_SEL
            pos64 = pos.to(tl.int64)
            q = tl.load(Q + b * sqb + pos64[:, None] * sqs + head[:, None] * sqh + ck[None, :],
                        mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            vis = kmask[None, :] & (kpos[None, :] <= Q0 + pos[:, None])
            s = tl.where(vis, s, float("-inf"))
            m = tl.max(s, 1)
            m = tl.where(m == float("-inf"), 0.0, m)
            p = tl.exp2(s - m[:, None])
            l_i = tl.sum(p, 1)
            has = l_i > 0.0
            o = tl.dot(p.to(v.dtype), v) / tl.where(has, l_i, 1.0)[:, None]
            lse = tl.where(has, m + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            prow = ((b * S + pos64) * HQ + head) * N_SEL + slot
            tl.store(OP + prow[:, None] * DV + cv[None, :], o.to(OP.dtype.element_ty),
                     mask=row_ok[:, None] & (cv[None, :] < DV))
            tl.store(LP + prow, lse, mask=row_ok)


@triton.jit
def _sel_merge_kernel(
    OP, LP, IDX, OUT, LSE, sob, sos, soh, N, S, HQ,
    HG: tl.constexpr, H: tl.constexpr, N_SEL: tl.constexpr, NSP: tl.constexpr, DV: tl.constexpr,
    BDV: tl.constexpr, BR: tl.constexpr,
):
    R = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    ok = R < N
    b = R // (S * HQ)
    pos = (R // HQ) % S
    head = R % HQ
    ns = tl.arange(0, NSP)
    cv = tl.arange(0, BDV)
    iv = tl.load(IDX + ((b * S + pos) * H + head // HG)[:, None] * N_SEL + ns[None, :],
                 mask=ok[:, None] & (ns[None, :] < N_SEL), other=-1)
    valid = iv >= 0
    lp = tl.load(LP + R[:, None] * N_SEL + ns[None, :], mask=valid, other=float("-inf"))
    mx = tl.max(lp, 1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wts = tl.where(valid, tl.exp2(lp - mx[:, None]), 0.0)
    den = tl.sum(wts, 1)
    has = den > 0.0
    wts = wts / tl.where(has, den, 1.0)[:, None]
    op = tl.load(OP + (R[:, None, None] * N_SEL + ns[None, :, None]) * DV + cv[None, None, :],
                 mask=valid[:, :, None] & (cv[None, None, :] < DV), other=0.0)
    o = tl.sum(op.to(tl.float32) * wts[:, :, None], 1)
    tl.store(LSE + R, tl.where(has, mx + tl.log2(tl.where(has, den, 1.0)), float("inf")), mask=ok)
    tl.store(OUT + b[:, None] * sob + pos[:, None] * sos + head[:, None] * soh + cv[None, :],
             o.to(OUT.dtype.element_ty), mask=ok[:, None] & (cv[None, :] < DV))


@triton.jit
def _dkdv_tile(Q, DOG, LSE, DELTA, DQP, WORK, k, v, dk, dv, e0, end, wbase, b, hq, kpos, kmask, ck, cv,
               sqb, sqs, sqh, sdb, sds, sdh, S, HQ, Q0, scale_log2, scale,
               N_SEL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr,
               WRITE_DQ: tl.constexpr, MASK: tl.constexpr, I32: tl.constexpr):
    """One tile of ``BM`` pairs of one head against the program's key block: dk/dv updates and, by
    ``WRITE_DQ``, none of dq (0), each pair's dq partial (1) or dq added atomically into fp32 rows ``[B*S*HQ,
    DK]`` (2). ``DOG``/``DELTA``: the branch's ``gate * do`` and delta. ``MASK``: the causal mask (else
    only keys past the block or the sequence are cut: the tile's positions all lie past the block);
    ``I32``: 32-bit offsets (every buffer under 2**31 elements)."""
    e = e0 + tl.arange(0, BM)
    row_ok = e < end
    f = tl.load(WORK + wbase + e, mask=row_ok, other=0)
    pos = f // N_SEL
    if not I32:
        pos = pos.to(tl.int64)
    row = (b * S + pos) * HQ + hq
    q = tl.load(Q + b * sqb + pos[:, None] * sqs + hq * sqh + ck[None, :],
                mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
    do = tl.load(DOG + b * sdb + pos[:, None] * sds + hq * sdh + cv[None, :],
                 mask=row_ok[:, None] & (cv[None, :] < DV), other=0.0)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASK:
        vis = row_ok[:, None] & kmask[None, :] & (kpos[None, :] <= Q0 + pos[:, None])
    else:
        vis = kmask[None, :]
    p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
    dv += tl.dot(tl.trans(p.to(do.dtype)), do)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    if WRITE_DQ == 1:
        slot = f - (f // N_SEL) * N_SEL
        dqp = tl.dot(ds.to(k.dtype), k) * scale
        tl.store(DQP + (row * N_SEL + slot)[:, None] * DK + ck[None, :], dqp.to(DQP.dtype.element_ty),
                 mask=row_ok[:, None] & (ck[None, :] < DK))
    elif WRITE_DQ == 2:
        dqp = tl.dot(ds.to(k.dtype), k) * scale
        tl.atomic_add(DQP + row[:, None] * DK + ck[None, :], dqp, mask=row_ok[:, None] & (ck[None, :] < DK),
                      sem="relaxed")
    return dk, dv


@triton.jit
def _sel_dkdv_kernel(
    Q, K, V, DOG, LSE, DELTA, DK_, DV_, DQP, WORK,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
    S, SK, HQ, Q0, NB, NW, WROW, SN, scale_log2, scale,
    HG: tl.constexpr, H: tl.constexpr, LS: tl.constexpr, BLS: tl.constexpr, N_SEL: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr,
    WRITE_DQ: tl.constexpr, I32: tl.constexpr,
):
    """dk/dv in the head order: one program per (query head, work item), the heads fastest in the flat grid
    (a group's heads are neighbouring programs on the same block and pairs); a tile is ``BM`` pairs of
    one head; dk/dv are added atomically into the group's fp32 rows. ``DOG``/``DELTA``: the branch's
    ``gate * do`` and delta. A block's pairs are ascending by position, so only its first ``LS`` pairs
    (the positions inside the block) need the causal mask: the later tiles skip it."""
    pid = tl.program_id(0).to(tl.int64)
    hq = (pid % HQ).to(tl.int32)
    rest = pid // HQ
    w = rest % NW
    b = rest // NW
    g = hq // HG
    wbase = (b * H + g) * WROW
    if I32:
        b = b.to(tl.int32)
    blk = tl.load(WORK + wbase + SN + w * 3)
    if blk < NB:
        start = tl.load(WORK + wbase + SN + w * 3 + 1)
        end = tl.load(WORK + wbase + SN + w * 3 + 2)
        kb = tl.arange(0, BLS)
        kpos = blk * LS + kb
        kpos64 = kpos.to(tl.int64)
        kmask = (kb < LS) & (kpos < SK)
        ck = tl.arange(0, BDK)
        cv = tl.arange(0, BDV)
        k = tl.load(K + b * skb + kpos64[:, None] * sks + g * skh + ck[None, :],
                    mask=kmask[:, None] & (ck[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + kpos64[:, None] * svs + g * svh + cv[None, :],
                    mask=kmask[:, None] & (cv[None, :] < DV), other=0.0)
        dk = tl.zeros([BLS, BDK], tl.float32)
        dv = tl.zeros([BLS, BDV], tl.float32)
        mid = tl.minimum(start + tl.cdiv(LS, BM) * BM, end)
        for e0 in range(start, mid, BM):
            dk, dv = _dkdv_tile(Q, DOG, LSE, DELTA, DQP, WORK, k, v, dk, dv, e0, end, wbase, b, hq, kpos,
                                kmask, ck, cv, sqb, sqs, sqh, sdb, sds, sdh, S, HQ, Q0, scale_log2, scale,
                                N_SEL, DK, DV, BM, WRITE_DQ, True, I32)
        for e0 in range(mid, end, BM):
            dk, dv = _dkdv_tile(Q, DOG, LSE, DELTA, DQP, WORK, k, v, dk, dv, e0, end, wbase, b, hq, kpos,
                                kmask, ck, cv, sqb, sqs, sqh, sdb, sds, sdh, S, HQ, Q0, scale_log2, scale,
                                N_SEL, DK, DV, BM, WRITE_DQ, False, I32)
        dk = dk * scale
        tl.atomic_add(DK_ + (b * SK + kpos64[:, None]) * H * DK + g * DK + ck[None, :], dk,
                      mask=kmask[:, None] & (ck[None, :] < DK), sem="relaxed")
        tl.atomic_add(DV_ + (b * SK + kpos64[:, None]) * H * DV + g * DV + cv[None, :], dv,
                      mask=kmask[:, None] & (cv[None, :] < DV), sem="relaxed")


@triton.jit
def _sel_dq_reduce_kernel(
    DQP, IDX, DQ, N, S, HQ,
    HG: tl.constexpr, H: tl.constexpr, N_SEL: tl.constexpr, NSP: tl.constexpr, DK: tl.constexpr,
    BDK: tl.constexpr, BR: tl.constexpr, ACCUM: tl.constexpr,
):
    R = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    ok = R < N
    b = R // (S * HQ)
    pos = (R // HQ) % S
    head = R % HQ
    ns = tl.arange(0, NSP)
    ck = tl.arange(0, BDK)
    iv = tl.load(IDX + ((b * S + pos) * H + head // HG)[:, None] * N_SEL + ns[None, :],
                 mask=ok[:, None] & (ns[None, :] < N_SEL), other=-1)
    part = tl.load(DQP + (R[:, None, None] * N_SEL + ns[None, :, None]) * DK + ck[None, None, :],
                   mask=(iv >= 0)[:, :, None] & (ck[None, None, :] < DK), other=0.0)
    dq = tl.sum(part.to(tl.float32), 1)
    ptrs = DQ + R[:, None] * DK + ck[None, :]
    msk = ok[:, None] & (ck[None, :] < DK)
    if ACCUM:
        dq += tl.load(ptrs, mask=msk, other=0.0).to(tl.float32)
    tl.store(ptrs, dq.to(DQ.dtype.element_ty), mask=msk)


# ---------------------------------------------------------------------------------------------------
# host side

def canonical_blocks(idx: torch.Tensor, l_sel: int, q_start: int = 0) -> torch.Tensor:
    """A given ``[B, S, H, n]`` block list as the kernels read it: per row the blocks that hold a
    visible key (``0 <= b <= t // l_sel``, row ``i`` at position ``t = q_start + i``) ascending and once
    each, then ``-1``. Same key set."""
    S = idx.shape[1]
    big = torch.iinfo(torch.int32).max
    t = torch.arange(q_start, q_start + S, device=idx.device, dtype=torch.int32)[None, :, None, None]
    x = idx.to(torch.int32)
    x = torch.where((x < 0) | (x > t // l_sel), big, x)
    x = torch.sort(x, dim=-1).values
    dup = torch.zeros_like(x, dtype=torch.bool)
    dup[..., 1:] = x[..., 1:] == x[..., :-1]
    x = torch.sort(torch.where(dup, big, x), dim=-1).values
    return torch.where(x == big, -1, x).contiguous()


def sel_mode(h: int, device: torch.device) -> str:
    """``row`` for large groups, ``fsa`` for small ones (override: tile key ``sel_mode``)."""
    mode = str(tuned("sel_mode", "row" if h >= 16 else "fsa"))
    if mode not in ("row", "fsa"):
        raise ValueError(f"sel_mode must be row or fsa, got {mode!r}")
    return mode


DQ_MODES = {"row": 0, "part": 1, "atomic": 2}  # the dk/dv kernel's WRITE_DQ of each


def sel_dq(h: int, device: torch.device, chunked: bool = False) -> str:
    """How the selected backward forms dq: ``row`` (a per-position kernel walking the position's blocks,
    the ``row`` mode's), ``part`` (each pair's partial from the dk/dv programs, then a reduction: the
    ``fsa`` mode's) or ``atomic`` (the dk/dv programs add each pair's dq into fp32 rows: no per-pair buffer,
    the ``fsa`` mode's where its buffers would not fit whole (``chunked``): at m7c 64k in chunks of 256 MiB
    the selected backward took 4.95 ms in chunks with partials and 3.72 ms whole with atomics, against 3.16
    whole with partials, H200, docs/kernels.md; override: tile key ``sel_dq``)."""
    fsa = "atomic" if chunked else "part"
    how = str(tuned("sel_dq", "row" if sel_mode(h, device) == "row" else fsa))
    if how not in DQ_MODES:
        raise ValueError(f"sel_dq must be row, part or atomic, got {how!r}")
    return how


def _pairs_per_program(device: torch.device, backward: bool = False) -> int:
    """Pairs of one work item: the forward's list (``fsa`` mode) 1024, a list built for the backward alone
    (``row`` mode) 4096 (fewer key-block loads and dk/dv atomics; H100 sweep, docs/kernels.md; the forward's
    list 512 -> 1024 took m7c 64k's selected backward 3.16 -> 2.99 ms, its forward unchanged, H200)."""
    if device.type != "cuda":
        return 32
    return int(tuned("selbwd_ch", 4096)) if backward else int(tuned("sel_ch", 1024))


def num_blocks(S: int, l_sel: int, q_start: int = 0) -> int:
    """Selection blocks the ``S`` query rows at positions ``q_start ..`` may choose (block numbers ``<
    NB``)."""
    return -(-(q_start + S) // l_sel)


# The FSA order's per-pair buffers (the forward's partial outputs, the backward's dq partials: one row of D
# per query head and slot) of one call at most this large (the tile override ``sel_partial_mib``, MiB): a
# larger call runs each batch row's forward in chunks of query rows (each a launch at its offset, as context
# parallelism runs one) and adds the backward's dq atomically (:func:`sel_dq`), so they stop growing with B
# and S. Chunks cost time: at m7c 64k (1.6 GB each unchunked) chunks of 256 MiB take the op's peak from 2,153
# to 943 MiB (1.94x dense) and its fwd+bwd from 14.1 to 15.0 ms (H200, 2026-11-29, ninth stop; with dq
# partials in chunks too 15.9 ms; 128k: 3,789 -> 1,888 MiB; docs/benchmarks/select-h200.md),
# so the default keeps whole calls up to m7c 128k at batch 1 and bounds what is beyond.
PARTIAL_BYTES = 4 * 2**30
CHUNK_ROWS = 1024  # chunks are whole multiples of this many query rows (of every selection block length used)


def query_chunks(B: int, S: int, HQ: int, n_sel: int, D: int,
                 itemsize: int = 2) -> list[tuple[int, int, int]]:
    """``(batch row, first, end)`` query-row chunks of the FSA order's launches: ``[(-1, 0, S)]`` (the whole
    call) while the call's per-pair buffers fit :data:`PARTIAL_BYTES`, else each batch row in chunks of a
    multiple of :data:`CHUNK_ROWS` rows that fit (shapes only: also under fake tensors)."""
    per_row = HQ * n_sel * D * itemsize
    budget = int(tuned("sel_partial_mib", 0)) * 2**20 or PARTIAL_BYTES
    if B * S * per_row <= budget:
        return [(-1, 0, S)]
    rows = max(CHUNK_ROWS, budget // per_row // CHUNK_ROWS * CHUNK_ROWS)
    return [(b, a, min(S, a + rows)) for b in range(B) for a in range(0, S, rows)]


def work_shape(B: int, S: int, H: int, n_sel: int, l_sel: int, device: torch.device,
               q_start: int = 0, backward: bool = False, chunked: bool = False) -> tuple[int, int]:
    """Shape of :func:`work_list`'s tensor (shapes only: also under fake tensors); ``chunked``: none (``[B*H,
    0]``: a forward in query chunks keeps no list, the backward builds one per chunk)."""
    if chunked:
        return B * H, 0
    sn = S * n_sel
    nw = num_blocks(S, l_sel, q_start) + -(-sn // _pairs_per_program(device, backward))
    return B * H, sn + 3 * nw


def work_list(idx: torch.Tensor, l_sel: int, q_start: int = 0, backward: bool = False) -> torch.Tensor:
    """Pairs sorted by chosen block, and the programs' work items, in one int32 tensor (device ops only): by
    Triton launches (:mod:`nsa.ops._triton.worklist`): three of one-hot counts up to 255 blocks, four of
    segment histograms and sorts beyond (m7c 64k chunked: 18.6 -> 16.2 ms fwd+bwd against the operators,
    H200); tile key ``sel_wl=sort``: the sorts at every block count, ``sel_wl=ops``: PyTorch operators
    throughout, as below (also where the sorts' histograms would pass
    :data:`~nsa.ops._triton.worklist.SORT_HIST_BYTES`).

    Row ``b*H + g``: ``S*n`` flat pair indices ``pos * n + slot`` ordered by block, then per work item
    ``(block, first, end)``: the pairs ``[first, end)`` of ``block``, at most ``CH`` of them (a block chosen
    by more pairs is split over several items). Items past the last have ``block = NB`` (:func:`num_blocks`;
    rows at positions ``q_start ..`` choose absolute block numbers). ``backward``: a list for the
    backward alone (larger chunks)."""
    B, S, H, n = idx.shape
    ch = _pairs_per_program(idx.device, backward)
    NB = num_blocks(S, l_sel, q_start)
    rows, width = work_shape(B, S, H, n, l_sel, idx.device, q_start, backward)
    how = str(tuned("sel_wl", "kernel"))
    if how not in ("ops", "kernel", "sort"):
        raise ValueError(f"sel_wl must be ops, kernel or sort, got {how!r}")
    if how == "kernel" and (idx.is_cuda or interpreting()) and worklist.fits(NB):
        built = worklist.FIRST_BUILD.run(lambda: worklist.build(idx, NB, ch, width))
        if built is not None:
            return built
    sorts = how in ("kernel", "sort") and worklist.sorted_fits(rows, S * n, NB)
    if sorts and (idx.is_cuda or interpreting()):
        built = worklist.FIRST_SORTED.run(lambda: worklist.build_sorted(idx, NB, ch, width))
        if built is not None:
            return built
    sn = S * n
    nw = (width - sn) // 3
    keys = idx.permute(0, 2, 1, 3).reshape(rows, sn).to(torch.int32)
    keys = torch.where(keys < 0, NB, keys)
    perm = torch.sort(keys, dim=1, stable=True).indices.to(torch.int32)
    counts = torch.zeros(rows, NB + 1, device=idx.device, dtype=torch.int64)
    counts.scatter_add_(1, keys.long(), torch.ones(rows, sn, device=idx.device, dtype=torch.int64))
    counts = counts[:, :NB]
    starts = torch.cumsum(counts, 1) - counts
    nch = torch.div(counts + ch - 1, ch, rounding_mode="floor")
    cum = torch.cumsum(nch, 1)
    wids = torch.arange(nw, device=idx.device, dtype=torch.int64).expand(rows, nw).contiguous()
    wblk = torch.searchsorted(cum, wids, right=True)
    wb = wblk.clamp(max=NB - 1)
    first = starts.gather(1, wb) + (wids - (cum - nch).gather(1, wb)) * ch
    end = torch.minimum(starts.gather(1, wb) + counts.gather(1, wb), first + ch)
    items = torch.stack([wblk, first, end], dim=2).reshape(rows, 3 * nw)
    return torch.cat([perm, items.to(torch.int32)], dim=1).contiguous()


def _extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last addressed one (a strided view reaches past its numel)."""
    return 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True) if n > 0)


def _common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, l_sel: int, kind: str) -> dict[str, int]:
    HQ, DK = q.shape[2], q.shape[3]
    H = k.shape[2]
    h = HQ // H
    DV = v.shape[-1]
    cfg = tile_config(q.device, h, DK, DV, kind)
    return dict(HG=h, H=H, LS=l_sel, BLS=max(16, next_pow2(l_sel)), DK=DK, DV=DV,
                BDK=max(16, next_pow2(DK)), BDV=max(16, next_pow2(DV)), BM=cfg.bm,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _row_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, l_sel: int, kind: str) -> dict[str, int]:
    """Launch settings of the row kernels: ``BH`` rows (the group's heads, at least 16)."""
    c = _common(q, k, v, l_sel, kind)
    del c["BM"]
    c["BH"] = max(16, next_pow2(c["HG"]))
    if q.is_cuda:
        c["num_warps"] = int(tuned(f"{kind}_warps", 4 if c["BH"] >= 64 else 2 if kind == "seldq" else 1))
        c["num_stages"] = int(tuned(f"{kind}_stages", 3 if kind == "seldq" else 2))
    return c


def _descriptors(k: torch.Tensor, v: torch.Tensor, c: dict[str, int]) -> tuple[object, object, bool]:
    """TMA descriptors of the key/value blocks on Hopper (else pointer loads)."""
    want = TensorDescriptor is not None and (
        bool(int(tuned("sel_tma", 1))) if k.is_cuda and cc_major(k.device) >= 9
        else interpreting() and bool(int(tuned("sel_tma", 0))))
    if not want:
        return None, None, False
    try:
        kd = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, c["BLS"], 1, c["BDK"]])
        vd = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, c["BLS"], 1, c["BDV"]])
    except (AssertionError, ValueError):  # alignment: pointer loads serve any strides
        return None, None, False
    return kd, vd, True


def sel_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, o: torch.Tensor, *,
    l_sel: int, scale: float, q_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the selected branch into ``o`` (a ``[B,S,HQ,Dv]`` view) from canonical ``idx``; return its
    lse (log2) and the work list for the backward (``fsa``; an empty tensor for ``row``). Query row
    ``i`` sits at position ``q_start + i``; ``k``/``v`` hold the keys from position 0."""
    B, S, HQ, _ = q.shape
    SK = k.shape[1]
    H, n_sel = k.shape[2], idx.shape[-1]
    lse = torch.empty(B, S, HQ, device=q.device, dtype=torch.float32)
    nsp = max(2, next_pow2(n_sel))
    if sel_mode(HQ // H, q.device) == "row":
        c = _row_config(q, k, v, l_sel, "sel")
        kd, vd, tma = _descriptors(k, v, c)
        _sel_fwd_row_kernel[(S, B * H)](
            q, k, v, idx, o, lse, kd, vd, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            S, SK, HQ, q_start, scale * LOG2E, N_SEL=n_sel, NSP=nsp, TMA=tma, **c,
        )
        return lse, idx.new_empty(0)
    chunks = query_chunks(B, S, HQ, n_sel, v.shape[-1])
    if len(chunks) == 1:
        return lse, _sel_fwd_fsa(q, k, v, idx, o, lse, l_sel, scale, q_start)
    lists, rows = chunk_lists(idx, chunks, l_sel, q_start)
    for i, (b, a, e) in enumerate(chunks):  # each chunk a launch at its offset, its rows of the one list
        _sel_fwd_fsa(q[b:b + 1, a:e], k[b:b + 1], v[b:b + 1], idx[b:b + 1, a:e], o[b:b + 1, a:e],
                     lse[b:b + 1, a:e], l_sel, scale, q_start + a, work=lists[i * H:(i + 1) * H],
                     list_rows=rows)
    return lse, idx.new_empty(*work_shape(B, S, H, n_sel, l_sel, q.device, chunked=True))


def chunk_lists(idx: torch.Tensor, chunks: list[tuple[int, int, int]], l_sel: int, q_start: int = 0,
                backward: bool = False) -> tuple[torch.Tensor, int]:
    """The work lists of every query chunk of a call (:func:`query_chunks`) in one build: each batch row's
    chunks stacked as rows of a batch (the last padded with ``-1``), over the call's blocks; chunk ``i``'s
    list is rows ``i*H .. (i+1)*H`` of the result (``backward``: :func:`work_list`'s). Also the chunks' row
    count (the lists' pair slots are ``rows * n``). One build instead of one per chunk: at m7c 64k in 256 MiB
    chunks the op's fwd+bwd 15.25 -> 15.02 ms, in 128 MiB chunks 16.00 -> 15.42 (H200, docs/kernels.md)."""
    B, S, H, n = idx.shape
    rows = chunks[0][2] - chunks[0][1]
    nc = -(-S // rows)
    padded = idx.new_full((B, nc * rows, H, n), -1)
    padded[:, :S] = idx
    return work_list(padded.view(B * nc, rows, H, n), l_sel, q_start + (nc - 1) * rows, backward), rows


def _sel_fwd_fsa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, l_sel: int, scale: float, q_start: int, work: torch.Tensor | None = None,
                 list_rows: int | None = None) -> torch.Tensor:
    """The FSA order's forward of these query rows into ``o`` and ``lse`` (contiguous); returns its work
    list (``work``: given, built for ``list_rows`` rows, :func:`chunk_lists`)."""
    B, S, HQ, _ = q.shape
    SK = k.shape[1]
    H, n_sel = k.shape[2], idx.shape[-1]
    nsp = max(2, next_pow2(n_sel))
    if work is None:
        work = work_list(idx, l_sel, q_start)
    c = _common(q, k, v, l_sel, "sel")
    NB = num_blocks(S, l_sel, q_start)
    sn = (list_rows or S) * n_sel
    nw = (work.shape[1] - sn) // 3
    o_part = torch.empty(B * S * HQ, n_sel, v.shape[-1], device=q.device, dtype=q.dtype)
    l_part = torch.empty(B * S * HQ, n_sel, device=q.device, dtype=torch.float32)
    _sel_fsa_fwd_kernel[(nw, B * H)](
        q, k, v, work, o_part, l_part, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        S, SK, HQ, q_start, NB, nw, work.shape[1], sn, scale * LOG2E, N_SEL=n_sel, **c,
    )
    N = B * S * HQ
    br = max(1, min(64, 8192 // (nsp * c["BDV"])))
    _sel_merge_kernel[(triton.cdiv(N, br),)](
        o_part, l_part, idx, o, lse, *o.stride()[:3], N, S, HQ, HG=c["HG"], H=H, N_SEL=n_sel, NSP=nsp,
        DV=c["DV"], BDV=c["BDV"], BR=br, num_warps=4,
    )
    return work


def sel_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, do: torch.Tensor,
    lse: torch.Tensor, gates: torch.Tensor, dg: torch.Tensor, dq: torch.Tensor, *, branch: int,
    accum: bool, l_sel: int, scale: float, work: torch.Tensor | None = None, q_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the selected branch's dq into ``dq`` (fp32 or q's dtype, the sum formed in fp32); return fp32 ``dk,
    dv`` of every key row (zeros where no query row reads it; ``work``: the forward's). Query row ``i`` sits
    at position ``q_start + i``."""
    B, S, HQ, _ = q.shape
    SK = k.shape[1]
    H, n_sel = k.shape[2], idx.shape[-1]
    nsp = max(2, next_pow2(n_sel))
    chunks = query_chunks(B, S, HQ, n_sel, q.shape[-1])
    dq_how = sel_dq(HQ // H, q.device, chunked=len(chunks) > 1)
    if dq_how != "part":  # only dq partials need the rows in chunks
        chunks = [(-1, 0, S)]
    if dq_how == "row":
        c = _row_config(q, k, v, l_sel, "seldq")
        kd, vd, tma = _descriptors(k, v, c)
        _sel_dq_row_kernel[(S, B * H)](
            q, k, v, do, idx, lse, gates, dg, dq, kd, vd, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], S, SK, HQ, q_start, scale * LOG2E, scale,
            N_SEL=n_sel, NSP=nsp, X=branch, TMA=tma, ACCUM=accum, **c,
        )
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    if len(chunks) == 1:
        if work is None or work.numel() == 0:
            work = work_list(idx, l_sel, q_start, backward=True)
        _sel_dkdv(q, k, v, idx, do, lse, gates, dg, dq, dk, dv, work, branch=branch, accum=accum, l_sel=l_sel,
                  scale=scale, q_start=q_start, dq_how=dq_how)
        return dk, dv
    lists, n_rows = chunk_lists(idx, chunks, l_sel, q_start, backward=True)
    for i, (b, a, e) in enumerate(chunks):  # each chunk a launch at its offset; dk/dv add up over them
        rows = (slice(b, b + 1), slice(a, e))
        _sel_dkdv(q[rows], k[b:b + 1], v[b:b + 1], idx[rows], do[rows], lse[rows], gates[rows], dg[rows],
                  dq[rows], dk[b:b + 1], dv[b:b + 1], lists[i * H:(i + 1) * H], branch=branch, accum=accum,
                  l_sel=l_sel, scale=scale, q_start=q_start + a, dq_how=dq_how, list_rows=n_rows)
    return dk, dv


def _sel_dkdv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
    gates: torch.Tensor, dg: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
              work: torch.Tensor,
    *, branch: int, accum: bool, l_sel: int, scale: float, q_start: int, dq_how: str,
    list_rows: int | None = None,
) -> None:
    """dk/dv of these query rows added into ``dk``/``dv`` (contiguous fp32), and their dq into ``dq``
    (contiguous): in ``part`` mode by partials and a reduction, in ``atomic`` mode added by the programs
    (``work`` built for ``list_rows`` rows where given, :func:`chunk_lists`)."""
    B, S, HQ, _ = q.shape
    SK = k.shape[1]
    H, n_sel = k.shape[2], idx.shape[-1]
    nsp = max(2, next_pow2(n_sel))
    c = _common(q, k, v, l_sel, "seldkdv")
    NB = num_blocks(S, l_sel, q_start)
    sn = (list_rows or S) * n_sel
    nw = (work.shape[1] - sn) // 3
    if dq_how == "part":
        dq_part = torch.empty(B * S * HQ, n_sel, q.shape[-1], device=q.device, dtype=q.dtype)
    elif dq_how == "atomic":  # into dq itself where it is fp32 and dense, else a fp32 buffer added at the end
        direct = dq.dtype == torch.float32 and dq.is_contiguous()
        dq_part = (dq if accum else dq.zero_()) if direct else torch.zeros(q.shape, device=q.device,
                                                                           dtype=torch.float32)
    else:
        dq_part = dq
    # the branch's gated do and delta once beforehand: scaling a loaded do tile before its product cost the
    # kernel 20% at the paper shape (a layout change per tile), the gate on the products' fp32 results 9%
    # (docs/kernels.md)
    gate = gates[..., branch]
    dog, delta = (do * gate.unsqueeze(-1)).to(do.dtype), gate.float() * dg[..., branch]
    i32 = max(_extent(q), _extent(dog), dq_part.numel(), lse.numel()) < 2**31
    _sel_dkdv_kernel[(HQ * nw * B,)](
        q, k, v, dog, lse, delta, dk, dv, dq_part, work, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *dog.stride()[:3], S, SK, HQ, q_start, NB, nw, work.shape[1], sn, scale * LOG2E, scale, N_SEL=n_sel,
        WRITE_DQ=DQ_MODES[dq_how], I32=i32, **c,
    )
    if dq_how == "atomic" and dq_part is not dq:
        (dq.add_ if accum else dq.copy_)(dq_part.view(dq.shape))
    if dq_how == "part":
        N = B * S * HQ
        br = max(1, min(64, 8192 // (nsp * c["BDK"])))
        _sel_dq_reduce_kernel[(triton.cdiv(N, br),)](
            dq_part, idx, dq, N, S, HQ, HG=c["HG"], H=H, N_SEL=n_sel, NSP=nsp, DK=c["DK"], BDK=c["BDK"],
            BR=br, ACCUM=accum, num_warps=4,
        )
