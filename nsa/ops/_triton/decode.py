"""Fused Triton decode step: one query per sequence against the NSA caches, in four launches.

Same call and result as the torch path ``nsa.ops.decode.nsa_decode`` (its reference), served by
``nsa_decode_triton``. Each program works on one KV group of one sequence (its ``h`` query heads are the
rows of a tile) and splits long key ranges over several programs (split-KV), so a batch of one still
fills the GPU:

1. ``_cmp_win_kernel``: the compressed branch over the visible compressed tokens and the sliding
   window (queried with ``q_win``'s rows when given), as split partials (running max, sum, weighted values;
   log2 domain). Each compressed tile also turns its probabilities into *block partials*: ``p @ W`` with the
   tile's overlap weights
   ``W[j, b] = overlap(j, b) / l`` (block-aligned tiles, so one ``W`` serves every tile), stored per
   head relative to the tile's running max; the part that spills into the next tile's first blocks
   is stored apart. No ``[h, N_c]`` score matrix is written.
2. ``_scores_kernel``: the block importances ``P[b]``, in parallel over chunks of blocks: each head's
   tile partials rescaled to the exact normaliser of its compressed softmax (from the split
   partials), summed over the heads of the group.
3. ``_sel_kernel``: top-n of ``P`` with the forced blocks (current, initial, previous) and ties to
   the lower index (one max over packed ``(score bits, -index)`` keys per pick, no sort), computed by
   every split of the group (split 0 publishes the ascending ``-1``-padded block list and the
   measured read count), then the selected branch over the chosen blocks' positions ``<= t``.
4. ``_combine_kernel``: merges each branch's splits and applies the gates.

No host sync; static shapes per cache size (CUDA graphs and ``torch.compile`` capture it).

Size: the four kernels of one fused decode step and their launcher, which must agree on layouts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops._triton import cc_major, interpreting, next_pow2, sm_count, tuned

LOG2E = 1.4426950408889634


@triton.jit
def _online_update(q, k, v, valid, m_i, l_i, acc, scale_log2, PREC: tl.constexpr):
    """One key tile of online softmax in the log2 domain; returns the new state and the tile's
    probabilities."""
    s = (tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2).to(tl.float32)
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, m_use, l_i, acc, p


@triton.jit
def _visible_cmp(t, L: tl.constexpr, D: tl.constexpr):
    """``N_c(t)``: compressed tokens whose last raw position is ``<= t``."""
    return tl.where(t + 1 >= L, (t + 1 - L) // D + 1, 0)


@triton.jit
def _group_queries(Q, b, g, sqb, sqh, HG: tl.constexpr, HP: tl.constexpr, DK: tl.constexpr,
                   BDK: tl.constexpr):
    """The ``HG`` query heads of KV group ``g`` of sequence ``b`` as the rows of a ``[HP, BDK]`` tile."""
    r = tl.arange(0, HP)
    ck = tl.arange(0, BDK)
    return tl.load(Q + b * sqb + (g * HG + r)[:, None] * sqh + ck[None, :],
                   mask=(r < HG)[:, None] & (ck[None, :] < DK), other=0.0)


@triton.jit
def _store_partial(M_OUT, L_OUT, A_OUT, row, row_ok, m_i, l_i, acc, DV: tl.constexpr, BDV: tl.constexpr):
    """One split's partial (running max, sum, weighted values) for the rows ``row``."""
    cv = tl.arange(0, BDV)
    tl.store(M_OUT + row, m_i, mask=row_ok)
    tl.store(L_OUT + row, l_i, mask=row_ok)
    tl.store(A_OUT + row[:, None] * DV + cv[None, :], acc, mask=row_ok[:, None] & (cv[None, :] < DV))


@triton.jit
def _cmp_win_kernel(
    Q, QW, KC, VC, KW, VW, T, M_OUT, L_OUT, A_OUT, PART, SPILL, MT,
    sqb, sqh, sqwb, sqwh, skcb, skch, skcs, svcb, svch, svcs, skwb, skwh, skws, svwb, svwh, svws,
    C, R, NB, scale_log2,
    H: tl.constexpr, HG: tl.constexpr, HP: tl.constexpr, NS_C: tl.constexpr, NS_W: tl.constexpr,
    NT_C: tl.constexpr, NT_W: tl.constexpr, L: tl.constexpr, D: tl.constexpr, LSEL: tl.constexpr,
                    W: tl.constexpr,
    NBT: tl.constexpr, NBT2: tl.constexpr, X: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BC: tl.constexpr,
    PREC: tl.constexpr, PREC_W: tl.constexpr,
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    g = bh % H
    t = tl.load(T + b).to(tl.int64)
    r = tl.arange(0, HP)
    row_ok = r < HG
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    n = tl.arange(0, BC)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, BDV], tl.float32)
    if split < NS_C:
        # compressed branch: tokens j < N_c(t); tiles of BC tokens start on selection-block boundaries
        q = _group_queries(Q, b, g, sqb, sqh, HG, HP, DK, BDK)
        n_c = _visible_cmp(t, L, D)
        jj = tl.arange(0, BC)[:, None]
        kb = tl.arange(0, NBT2)[None, :]
        lo = tl.maximum(jj * D, kb * LSEL)
        hi = tl.minimum(jj * D + L, (kb + 1) * LSEL)
        wt = tl.maximum(hi - lo, 0).to(tl.float32) / L  # [BC, NBT2], the same for every tile
        kcol = tl.arange(0, NBT2)
        for i0 in range(0, NT_C, NS_C):
            i = i0 + split
            j = i * BC + n
            valid = (j < n_c) & (j < C)
            k = tl.load(KC + b * skcb + g * skch + j[:, None] * skcs + ck[None, :],
                        mask=valid[:, None] & (ck[None, :] < DK), other=0.0)
            v = tl.load(VC + b * svcb + g * svch + j[:, None] * svcs + cv[None, :],
                        mask=valid[:, None] & (cv[None, :] < DV), other=0.0)
            m_i, m_use, l_i, acc, p = _online_update(q, k, v, valid, m_i, l_i, acc, scale_log2, PREC)
            part = tl.dot(p, wt, input_precision=PREC_W)  # [HP, NBT2] block partials, relative to m_use
            blk = i * NBT + kcol
            seen = row_ok & ((r * 0 + i * BC) < n_c)  # tiles past the visible tokens store nothing
            tl.store(PART + (bh * HG + r)[:, None] * NB + blk[None, :], part,
                     mask=seen[:, None] & (kcol[None, :] < NBT) & (blk[None, :] < NB))
            if X > 0:
                sp = kcol - NBT
                tl.store(SPILL + ((bh * NT_C + i) * HG + r)[:, None] * X + sp[None, :], part,
                         mask=seen[:, None] & (sp[None, :] >= 0) & (sp[None, :] < X))
            tl.store(MT + (bh * NT_C + i) * HG + r, m_use, mask=seen)
    else:
        # sliding window from the ring: positions t-R+1 .. t, slot p % R, visible if p > t - W;
        # its own queries QW (the launcher passes Q itself when there are none)
        q = _group_queries(QW, b, g, sqwb, sqwh, HG, HP, DK, BDK)
        ws = split - NS_C
        for i0 in range(0, NT_W, NS_W):
            i = i0 + ws
            p_pos = t - R + 1 + i * BC + n
            valid = (p_pos >= 0) & (p_pos <= t) & (p_pos > t - W)
            slot = tl.where(valid, p_pos % R, 0)
            k = tl.load(KW + b * skwb + g * skwh + slot[:, None] * skws + ck[None, :],
                        mask=valid[:, None] & (ck[None, :] < DK), other=0.0)
            v = tl.load(VW + b * svwb + g * svwh + slot[:, None] * svws + cv[None, :],
                        mask=valid[:, None] & (cv[None, :] < DV), other=0.0)
            m_i, m_use, l_i, acc, p = _online_update(q, k, v, valid, m_i, l_i, acc, scale_log2, PREC)
    _store_partial(M_OUT, L_OUT, A_OUT, (bh * (NS_C + NS_W) + split) * HG + r, row_ok, m_i, l_i, acc, DV, BDV)


@triton.jit
def _beaten_by(v, idx, V_SCR, I_SCR, N: tl.constexpr, JB: tl.constexpr, HAS_IDX: tl.constexpr):
    """For keys ``(v, idx)`` (larger value first, then lower index): how many of the ``N`` keys stored
    at ``V_SCR`` (indices at ``I_SCR``, or their positions when not ``HAS_IDX``) beat each one.
    Read back in sub-blocks of ``JB`` so the pairwise comparison stays small."""
    cnt = tl.zeros(v.shape, tl.int32)
    for j0 in tl.static_range(0, N, JB):
        jj = j0 + tl.arange(0, JB)
        vj = tl.load(V_SCR + jj)
        ij = tl.load(I_SCR + jj) if HAS_IDX else jj
        beats = (vj[None, :] > v[:, None]) | ((vj[None, :] == v[:, None]) & (ij[None, :] < idx[:, None]))
        cnt += tl.sum(beats.to(tl.int32), 1)
    return cnt


@triton.jit
def _scores_kernel(
    M_IN, L_IN, PART, SPILL, MT, T, K_SCR, CAND_V, CAND_B,
    NB,
    H: tl.constexpr, HG: tl.constexpr, HGP: tl.constexpr, NS_C: tl.constexpr, NS1: tl.constexpr,
    NSP: tl.constexpr, NT_C: tl.constexpr, L: tl.constexpr, D: tl.constexpr, LSEL: tl.constexpr,
    NBT: tl.constexpr, X: tl.constexpr, BC: tl.constexpr, NBP: tl.constexpr, NBC: tl.constexpr,
    KC: tl.constexpr, NCAND: tl.constexpr, JB: tl.constexpr,
):
    """Block importances ``P[b]`` of NBC blocks of one group (each head's tile partials rescaled to
    the head's global max and normaliser from the compressed splits' partials, summed over heads),
    turned into selection keys; the chunk's best ``KC`` keys go to the group's candidate row."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    t = tl.load(T + b).to(tl.int64)
    n_c = _visible_cmp(t, L, D)
    r = tl.arange(0, HGP)
    row_ok = r < HG
    sp = tl.arange(0, NSP)
    off = (bh * NS1 + sp)[:, None] * HG + r[None, :]
    ok = (sp[:, None] < NS_C) & row_ok[None, :]
    ms = tl.load(M_IN + off, mask=ok, other=float("-inf"))
    ls = tl.load(L_IN + off, mask=ok, other=0.0)
    m_all = tl.max(ms, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.sum(ls * tl.exp2(ms - m_all[None, :]), 0)
    inv = tl.where(l_all > 0, 1.0 / tl.where(l_all > 0, l_all, 1.0), 0.0)

    blk = tl.program_id(1) * NBC + tl.arange(0, NBC)
    tile = blk // NBT
    kb = blk % NBT
    own = ((blk < NB) & (tile * BC < n_c))[None, :] & row_ok[:, None]
    mt = tl.load(MT + (bh * NT_C + tile[None, :]) * HG + r[:, None], mask=own, other=0.0)
    part = tl.load(PART + (bh * HG + r[:, None]) * NB + blk[None, :], mask=own, other=0.0)
    contrib = part * tl.exp2(mt - m_all[:, None])
    if X > 0:
        prev = tl.maximum(tile - 1, 0)
        spl = ((blk < NB) & (kb < X) & (tile >= 1) & ((tile - 1) * BC < n_c))[None, :] & row_ok[:, None]
        mt_prev = tl.load(MT + (bh * NT_C + prev[None, :]) * HG + r[:, None], mask=spl, other=0.0)
        s_part = tl.load(SPILL + ((bh * NT_C + prev[None, :]) * HG + r[:, None]) * X + kb[None, :],
                         mask=spl, other=0.0)
        contrib += s_part * tl.exp2(mt_prev - m_all[:, None])
    P = tl.sum(contrib * inv[:, None], 0)
    # selection keys: forced blocks outrank every score (current > initial > previous), then the
    # score (P >= 0, so its bit pattern orders like the value), then the lower index; -1: no candidate
    bt = t // LSEL
    key = P.to(tl.int32, bitcast=True)
    inf_bits = 0x7F800000
    key = tl.where(blk == bt - 1, inf_bits + 1, key)
    key = tl.where(blk == 0, inf_bits + 2, key)
    key = tl.where(blk == bt, inf_bits + 3, key)
    key = tl.where((blk <= bt) & (blk < NB), key, -1)
    # this chunk's best KC keys, kept in block order (so the group's candidate row is block-sorted)
    scr = K_SCR + bh * NBP + blk
    tl.store(scr, key)
    tl.debug_barrier()
    beaten = _beaten_by(key, blk, K_SCR + bh * NBP + tl.program_id(1) * NBC, K_SCR, NBC, JB, False)
    keep = (beaten < KC) & (key >= 0)
    slot = tl.cumsum(keep.to(tl.int32), 0) - 1
    n_kept = tl.sum(keep.to(tl.int32), 0)
    kc = tl.arange(0, KC)
    row = tl.program_id(1) * KC + bh * NCAND
    tl.store(CAND_V + row + slot, key, mask=keep)
    tl.store(CAND_B + row + slot, blk, mask=keep)
    tl.store(CAND_V + row + kc, tl.full([KC], -1, tl.int32), mask=kc >= n_kept)
    tl.store(CAND_B + row + kc, tl.full([KC], 0, tl.int32), mask=kc >= n_kept)


@triton.jit
def _sel_kernel(
    Q, K, V, T, CAND_V, CAND_B, BLK_SCR, BLK_OUT, READS_OUT, M_OUT, L_OUT, A_OUT,
    sqb, sqh, skb, skh, sks, svb, svh, svs, scale_log2, NB, R,
    H: tl.constexpr, HG: tl.constexpr, HP: tl.constexpr, NS: tl.constexpr, NTILES: tl.constexpr,
    L: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NSEL: tl.constexpr, NSELP: tl.constexpr,
    LSEL: tl.constexpr, TPB: tl.constexpr, NBP: tl.constexpr, NCAND: tl.constexpr, JB: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
    PREC: tl.constexpr,
):
    """Top-n of the group's block importances (every split computes it, split 0 publishes it), then
    the selected branch over this split's tiles of the chosen blocks, as split partials."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    g = bh % H
    t = tl.load(T + b).to(tl.int64)

    # top-n of the candidates (the union of every chunk's best keys holds the group's best n_sel);
    # the candidate row is in block order, so the chosen ones' ascending positions are a running count
    c = tl.arange(0, NCAND)
    key = tl.load(CAND_V + bh * NCAND + c)
    blk = tl.load(CAND_B + bh * NCAND + c)
    beaten = _beaten_by(key, blk, CAND_V + bh * NCAND, CAND_B + bh * NCAND, NCAND, JB, True)
    chosen = (beaten < NSEL) & (key >= 0)
    cnt = tl.sum(chosen.to(tl.int32), 0)
    rank = tl.cumsum(chosen.to(tl.int32), 0) - 1
    kk = tl.arange(0, NSELP)
    # ascending block list, -1 padded, in this program's scratch row (read back per tile below)
    row_scr = BLK_SCR + (bh * NS + split) * NSEL
    tl.store(row_scr + rank, blk, mask=chosen)
    tl.store(row_scr + kk, tl.full([NSELP], -1, tl.int32), mask=(kk >= cnt) & (kk < NSEL))
    if split == 0:
        tl.store(BLK_OUT + bh * NSEL + rank, blk, mask=chosen)
        tl.store(BLK_OUT + bh * NSEL + kk, tl.full([NSELP], -1, tl.int32), mask=(kk >= cnt) & (kk < NSEL))
        # reads = visible compressed + selected positions <= t + window
        n_c = _visible_cmp(t, L, D)
        in_blk = tl.minimum(tl.maximum(t - blk.to(tl.int64) * LSEL + 1, 0), LSEL)
        sel_reads = tl.sum(tl.where(chosen, in_blk, 0), 0)
        win_reads = tl.minimum(tl.minimum(t + 1, W), R)
        tl.store(READS_OUT + bh, n_c + sel_reads + win_reads)
    tl.debug_barrier()

    r = tl.arange(0, HP)
    row_ok = r < HG
    ck = tl.arange(0, BDK)
    cv = tl.arange(0, BDV)
    n = tl.arange(0, BN)
    q = _group_queries(Q, b, g, sqb, sqh, HG, HP, DK, BDK)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, BDV], tl.float32)
    for i0 in range(0, NTILES, NS):
        i = i0 + split
        bi = tl.load(row_scr + i // TPB, mask=i < NTILES, other=-1).to(tl.int64)
        off = (i % TPB) * BN + n
        p_pos = bi * LSEL + off
        valid = (off < LSEL) & (p_pos >= 0) & (p_pos <= t)  # bi = -1 gives p_pos < 0
        slot = tl.where(valid, p_pos, 0)
        k = tl.load(K + b * skb + g * skh + slot[:, None] * sks + ck[None, :],
                    mask=valid[:, None] & (ck[None, :] < DK), other=0.0)
        v = tl.load(V + b * svb + g * svh + slot[:, None] * svs + cv[None, :],
                    mask=valid[:, None] & (cv[None, :] < DV), other=0.0)
        m_i, _m, l_i, acc, _p = _online_update(q, k, v, valid, m_i, l_i, acc, scale_log2, PREC)
    _store_partial(M_OUT, L_OUT, A_OUT, (bh * NS + split) * HG + r, row_ok, m_i, l_i, acc, DV, BDV)


@triton.jit
def _merge(M_IN, L_IN, A_IN, bh, hr, c, c_ok, NS: tl.constexpr, S0: tl.constexpr, SN: tl.constexpr,
           NSP: tl.constexpr, HG: tl.constexpr, DV: tl.constexpr):
    """Normalised output of splits ``S0 .. S0+SN-1`` (of ``NS`` per group) for head row ``hr``, columns
    ``c``."""
    sp = tl.arange(0, NSP)
    row = (bh * NS + S0 + sp) * HG + hr
    ok = sp < SN
    ms = tl.load(M_IN + row, mask=ok, other=float("-inf"))
    ls = tl.load(L_IN + row, mask=ok, other=0.0)
    a = tl.load(A_IN + row[:, None] * DV + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
    m = tl.max(ms, 0)
    w = tl.exp2(ms - tl.where(m == float("-inf"), 0.0, m))  # a split without a visible key weighs 0
    den = tl.sum(w * ls, 0)
    return tl.sum(w[:, None] * a, 0) / tl.where(den > 0, den, 1.0)


@triton.jit
def _combine_kernel(
    M1, L1, A1, M2, L2, A2, G, OUT,
    sgb, sgh, sgk, sob, soh,
    H: tl.constexpr, HG: tl.constexpr, NS_C: tl.constexpr, NS_W: tl.constexpr,
    NS_S: tl.constexpr, NSPC: tl.constexpr, NSPW: tl.constexpr, NSPS: tl.constexpr, DV: tl.constexpr,
    DVC: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = pid // HG
    hr = pid % HG
    b = (bh // H).to(tl.int64)
    head = (bh % H) * HG + hr
    c = tl.program_id(1) * DVC + tl.arange(0, DVC)
    c_ok = c < DV
    o_cmp = _merge(M1, L1, A1, bh, hr, c, c_ok, NS_C + NS_W, 0, NS_C, NSPC, HG, DV)
    o_win = _merge(M1, L1, A1, bh, hr, c, c_ok, NS_C + NS_W, NS_C, NS_W, NSPW, HG, DV)
    o_sel = _merge(M2, L2, A2, bh, hr, c, c_ok, NS_S, 0, NS_S, NSPS, HG, DV)
    gp = G + b * sgb + head * sgh
    g0 = tl.load(gp).to(tl.float32)
    g1 = tl.load(gp + sgk).to(tl.float32)
    g2 = tl.load(gp + 2 * sgk).to(tl.float32)
    o = g0 * o_cmp + g1 * o_sel + g2 * o_win
    tl.store(OUT + b * sob + head * soh + c, o.to(OUT.dtype.element_ty), mask=c_ok)


# --------------------------------------------------------------------------------------------------
# host side


def _splits(work_tiles: int, groups: int, device: torch.device, min_tiles: int = 2) -> int:
    """Programs per (sequence, group) for a key range of ``work_tiles`` tiles: about two waves of
    programs in all, each with at least ``min_tiles`` tiles (CPU interpreter: 2)."""
    if device.type != "cuda":
        return max(1, min(2, work_tiles))
    want = -(-int(tuned("dec_waves", 2)) * sm_count(device) // max(1, groups))
    return max(1, min(want, -(-work_tiles // min_tiles)))


def decode_unsupported(l: int, d: int, l_sel: int, *tensors: torch.Tensor) -> str | None:  # noqa: E741
    """None when the fused kernels can serve this call, else a short reason (the caller falls back)."""
    interp = interpreting()
    for x in tensors:
        if not (x.is_cuda or (interp and x.device.type == "cpu")):
            return f"{x.device.type} tensor"
        if x.is_floating_point() and x.dtype == torch.float64:
            return "float64"
    cuda = [x for x in tensors if x.is_cuda]
    if cuda and cc_major(cuda[0].device) < 8:  # bf16 tensor-core dots need Ampere or newer
        return "compute capability < 8.0"
    tpb = l_sel // d
    if tpb & (tpb - 1) or tpb > 64:
        return f"l_sel/d={tpb} is not a power of two <= 64"
    if -(-(l - d) // l_sel) > 64 // tpb:
        return "compressed tokens span more blocks than a tile"
    return None


def nsa_decode_triton(
    q: torch.Tensor,
    t: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    *,
    l: int,  # noqa: E741
    d: int,
    l_sel: int,
    n_sel: int,
    w: int,
    scale: float,
    q_win: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused step (see the module doc): ``(o [B, HQ, Dv], block_idx int32 [B, H, n_sel], reads [B, H])``.
    ``q_win`` (``q``'s shape and dtype; ``None``: ``q``) are the window branch's queries; the compressed
    and selected branches and the block scores use ``q``. Callers check ``decode_unsupported`` first."""
    B, HQ, Dk = q.shape
    H, C, T, R = k_cmp.shape[1], k_cmp.shape[2], k_sel.shape[2], k_win.shape[2]
    Dv = v_sel.shape[-1]
    h = HQ // H
    dev = q.device
    cuda = dev.type == "cuda"
    HP, BDK, BDV = max(16, next_pow2(h)), max(16, next_pow2(Dk)), max(16, next_pow2(Dv))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    tpb = l_sel // d
    BC = max(64 if cuda else 16, tpb)
    NBT = BC // tpb
    X = -(-(l - d) // l_sel)
    NBT2 = max(16, next_pow2(NBT + X))
    NB = -(-T // l_sel)
    NT_C, NT_W = -(-C // BC), -(-R // BC)
    G = B * H
    ns_c = _splits(NT_C, G, dev, int(tuned("dec_cmp_min_tiles", 1)))
    ns_w = _splits(NT_W, G, dev, int(tuned("dec_win_min_tiles", 2)))
    ns1 = ns_c + ns_w
    qc = q.contiguous()
    qw = qc if q_win is None else q_win.contiguous()
    k_cmp, v_cmp, k_sel, v_sel, k_win, v_win = (x if x.stride(-1) == 1 else x.contiguous()
                                                for x in (k_cmp, v_cmp, k_sel, v_sel, k_win, v_win))
    t = t.to(device=dev, dtype=torch.int64).contiguous()

    def f32(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32, device=dev)

    m1 = f32(G * ns1 * h)
    l1 = torch.empty_like(m1)
    a1 = f32(G * ns1 * h * Dv)
    part = f32(G * h * NB)
    spill = f32(max(1, G * NT_C * h * X))
    mt = f32(G * NT_C * h)
    scale_log2 = scale * LOG2E
    _cmp_win_kernel[(ns1, G)](
        qc, qw, k_cmp, v_cmp, k_win, v_win, t, m1, l1, a1, part, spill, mt,
        qc.stride(0), qc.stride(1), qw.stride(0), qw.stride(1), k_cmp.stride(0), k_cmp.stride(1),
                              k_cmp.stride(2),
        v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2), k_win.stride(0), k_win.stride(1), k_win.stride(2),
        v_win.stride(0), v_win.stride(1), v_win.stride(2),
        C, R, NB, scale_log2,
        H=H, HG=h, HP=HP, NS_C=ns_c, NS_W=ns_w, NT_C=NT_C, NT_W=NT_W, L=l, D=d, LSEL=l_sel, W=w,
        NBT=NBT, NBT2=NBT2, X=X, DK=Dk, DV=Dv, BDK=BDK, BDV=BDV, BC=BC, PREC=prec,
        PREC_W=str(tuned("dec_part_prec", "tf32x3")) if cuda else "ieee",
                              num_warps=int(tuned("dec_cmp_warps", 4)),
        num_stages=int(tuned("dec_cmp_stages", 3 if BDK <= 64 else 2)) if cuda else 1,
    )
    block_idx = torch.empty(B, H, n_sel, dtype=torch.int32, device=dev)
    reads = torch.empty(B, H, dtype=torch.int64, device=dev)
    NBP = max(16, next_pow2(NB))
    HGP = next_pow2(h)
    NBC = min(NBP, int(tuned("dec_score_cols", 128)))
    KC = max(2, next_pow2(min(n_sel, NBC)))
    NCAND = NBP // NBC * KC
    # sub-blocks of 32 keys per comparison (measured on an H100: a square 128 x 128 comparison spills
    # and makes the step twice as slow)
    JB = min(int(tuned("dec_rank_block", 32)), NBC, NCAND)
    k_scr = torch.empty(G * NBP, dtype=torch.int32, device=dev)
    cand_v = torch.empty(G * NCAND, dtype=torch.int32, device=dev)
    cand_b = torch.empty_like(cand_v)
    _scores_kernel[(G, NBP // NBC)](
        m1, l1, part, spill, mt, t, k_scr, cand_v, cand_b, NB,
        H=H, HG=h, HGP=HGP, NS_C=ns_c, NS1=ns1, NSP=max(2, next_pow2(ns_c)), NT_C=NT_C, L=l, D=d, LSEL=l_sel,
        NBT=NBT, X=X, BC=BC, NBP=NBP, NBC=NBC, KC=KC, NCAND=NCAND, JB=JB,
        num_warps=int(tuned("dec_score_warps", 4)),
    )
    BN = max(16, min(64, next_pow2(l_sel)))
    tpb_s = -(-l_sel // BN)
    nt_s = n_sel * tpb_s
    ns_s = _splits(nt_s, G, dev, int(tuned("dec_sel_min_tiles", 1)))
    m2 = f32(G * ns_s * h)
    l2 = torch.empty_like(m2)
    a2 = f32(G * ns_s * h * Dv)
    blk_scr = torch.empty(G * ns_s * n_sel, dtype=torch.int32, device=dev)
    _sel_kernel[(ns_s, G)](
        qc, k_sel, v_sel, t, cand_v, cand_b, blk_scr, block_idx, reads, m2, l2, a2,
        qc.stride(0), qc.stride(1), k_sel.stride(0), k_sel.stride(1), k_sel.stride(2),
        v_sel.stride(0), v_sel.stride(1), v_sel.stride(2), scale_log2, NB, R,
        H=H, HG=h, HP=HP, NS=ns_s, NTILES=nt_s, L=l, D=d, W=w, NSEL=n_sel, NSELP=max(2, next_pow2(n_sel)),
        LSEL=l_sel, TPB=tpb_s, NBP=NBP, NCAND=NCAND, JB=JB, DK=Dk, DV=Dv, BDK=BDK, BDV=BDV, BN=BN, PREC=prec,
        num_warps=int(tuned("dec_sel_warps", 8)), num_stages=int(tuned("dec_sel_stages", 2)) if cuda else 1,
    )
    o = torch.empty(B, HQ, Dv, dtype=v_sel.dtype, device=dev)
    DVC = min(BDV, int(tuned("dec_combine_cols", 64)))
    _combine_kernel[(G * h, -(-Dv // DVC))](
        m1, l1, a1, m2, l2, a2, gates, o,
        gates.stride(0), gates.stride(1), gates.stride(2), o.stride(0), o.stride(1),
        H=H, HG=h, NS_C=ns_c, NS_W=ns_w, NS_S=ns_s, NSPC=max(2, next_pow2(ns_c)),
        NSPW=max(2, next_pow2(ns_w)), NSPS=max(2, next_pow2(ns_s)), DV=Dv, DVC=DVC,
        num_warps=int(tuned("dec_combine_warps", 2)),
    )
    return o, block_idx, reads
