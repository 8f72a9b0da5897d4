"""Block importance (paper Eqs. 8-10) and top-n selection, without a ``[S, S_cmp]`` matrix in memory.

``_block_scores``: one program per tile of packed query rows of a group recomputes the compressed
scores chunk by chunk (using the compressed forward's ``lse``), weights them by the overlap of each
compressed token with each selection block (a small matrix product with ``W[j, b] = overlap / l``,
built in registers) and sums the group's heads (a 0/1 matrix product), writing the group-summed
importance ``P [B*H, slab, n_blocks]`` (fp32). ``top_blocks`` turns ``P`` into the spec's indices:
forced blocks (current, 0, previous) first, then the highest ``P``, ties to the lower index,
ascending, ``-1`` padded. Query row ``t`` sits at position ``Q0 + t`` (queries at an offset); block
numbers are absolute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops._triton import next_pow2, tile_config, tuned
from nsa.ops._triton.range_attn import LOG2E


@triton.jit
def _block_scores_kernel(
    Q, K, LSE, P,
    sqb, sqs, sqh, skb, sks, skh,
    S, T0, T1, NK, NB, HQ, Q0, scale_log2,
    HG: tl.constexpr, HGP: tl.constexpr, H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, LS: tl.constexpr,
    DK: tl.constexpr, BDK: tl.constexpr, BM: tl.constexpr, BJ: tl.constexpr,
    NBC: tl.constexpr, NBCP: tl.constexpr, BTP: tl.constexpr, PREC: tl.constexpr, RESHAPE: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    g = bh % H
    # HGP >= HG rows per position (padded to a power of two: the head sum is then a reshape)
    BT: tl.constexpr = BM // HGP
    PB: tl.constexpr = LS // D  # compressed tokens per selection block
    HALO: tl.constexpr = L // D - 1  # earlier tokens that reach into a block
    t0 = T0 + pid * BT
    r = tl.arange(0, BM)
    pos = t0 + r // HGP
    head = g * HG + r % HGP
    row_ok = (r < BT * HGP) & (pos < T1) & (r % HGP < HG)
    ck = tl.arange(0, BDK)
    pos64 = pos.to(tl.int64)
    q = tl.load(Q + b * sqb + pos64[:, None] * sqs + head[:, None] * sqh + ck[None, :],
                mask=row_ok[:, None] & (ck[None, :] < DK), other=0.0)
    lse = tl.load(LSE + (b * S + pos64) * HQ + head, mask=row_ok, other=float("inf"))
    apos = Q0 + pos  # absolute positions of the rows (queries at an offset)
    t_last = Q0 + tl.minimum(t0 + BT - 1, T1 - 1)
    n_all = (t_last // LS + NBC) // NBC  # chunks of NBC blocks up to the tile's last block
    # chunk c holds blocks c*NBC .. and the tokens from c*NBC*PB - HALO on, so the overlap matrix
    # W[j, b] = overlap(token, block) / l is the same for every chunk (built once)
    jj = tl.arange(0, BJ)
    bb = tl.arange(0, NBCP)
    o = jj[:, None] - bb[None, :] * PB - HALO
    overlap = tl.maximum(tl.minimum(o + HALO + 1, PB) - tl.maximum(o, 0), 0)
    w = tl.where(bb[None, :] < NBC, overlap.to(tl.float32) * D / L, 0.0)
    # head-sum matrix: E[i, r] = 1 iff row r belongs to the tile's i-th position
    ti = tl.arange(0, BTP)
    E = tl.where((r[None, :] // HGP == ti[:, None]) & (r[None, :] < BT * HGP), 1.0, 0.0)
    # the chunks every row of the tile sees whole need no mask: their last token c*NBC*PB - HALO + BJ - 1
    # is at most the last token the tile's first position sees
    num = (Q0 + t0 - L + 1) // D + HALO - BJ + 1
    n_full = tl.minimum(tl.where(num >= 0, num // (NBC * PB) + 1, 0), n_all)
    # chunk 0 reaches before token 0 (masked), then the whole chunks, then the partly visible ones
    _score_chunk(K, P, q, lse, apos, E, w, b, g, bh, t0, 0, T0, T1, NK, NB, skb, sks, skh, scale_log2, jj, bb,
                 HGP, L, D, DK, BDK, BJ, NBC, NBCP, BT, BTP, PB, HALO, PREC, RESHAPE, MASK=True)
    for c in range(1, n_full):
        _score_chunk(K, P, q, lse, apos, E, w, b, g, bh, t0, c, T0, T1, NK, NB, skb, sks, skh, scale_log2, jj,
                     bb, HGP, L, D, DK, BDK, BJ, NBC, NBCP, BT, BTP, PB, HALO, PREC, RESHAPE, MASK=False)
    for c in range(tl.maximum(n_full, 1), n_all):
        _score_chunk(K, P, q, lse, apos, E, w, b, g, bh, t0, c, T0, T1, NK, NB, skb, sks, skh, scale_log2, jj,
                     bb, HGP, L, D, DK, BDK, BJ, NBC, NBCP, BT, BTP, PB, HALO, PREC, RESHAPE, MASK=True)


@triton.jit
def _score_chunk(K, P, q, lse, apos, E, w, b, g, bh, t0, c, T0, T1, NK, NB, skb, sks, skh, scale_log2, jj, bb,
                 HGP: tl.constexpr, L: tl.constexpr, D: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr,
                 BJ: tl.constexpr, NBC: tl.constexpr, NBCP: tl.constexpr, BT: tl.constexpr, BTP: tl.constexpr,
                 PB: tl.constexpr, HALO: tl.constexpr, PREC: tl.constexpr, RESHAPE: tl.constexpr,
                 MASK: tl.constexpr):
    """Blocks ``c*NBC ..`` of the tile's positions: the compressed probabilities of the chunk's tokens,
    weighted by ``w`` and summed over the group's heads, stored into ``P``. ``MASK``: some token is not
    visible to some row (or lies before token 0)."""
    ck = tl.arange(0, BDK)
    j = c * NBC * PB - HALO + jj
    j64 = j.to(tl.int64)
    k = tl.load(K + b * skb + j64[:, None] * sks + g * skh + ck[None, :],
                mask=(j[:, None] >= 0) & (j[:, None] < NK) & (ck[None, :] < DK), other=0.0)
    s = tl.dot(q, tl.trans(k))
    p = tl.exp2(s * scale_log2 - lse[:, None])
    if MASK:
        vis = (j[None, :] * D + L - 1 <= apos[:, None]) & (j[None, :] >= 0) & (j[None, :] < NK)
        p = tl.where(vis, p, 0.0)
    if PREC == "bf16":
        p_rows = tl.dot(p.to(tl.bfloat16), w.to(tl.bfloat16))
    elif PREC == "fp16":
        # the default on CUDA: tf32's 10-bit mantissa, rounded, at fp16's rate (12-14% off the select stage,
        # as many blocks as tf32's agree with the fp32 product: H200, issue 53); p scaled by 2**14 (p <= 1: no
        # overflow, normal down to 4e-9), w's multiples of d/l, the sum scaled back exactly
        p_rows = tl.dot((p * 16384.0).to(tl.float16), w.to(tl.float16)) * (1.0 / 16384.0)
    else:
        p_rows = tl.dot(p, w, input_precision=PREC)
    blk = c * NBC + bb
    if RESHAPE:
        # the tile's rows are [BT, HGP] and the head sum is a reduction (padded rows hold zeros)
        p_pos = tl.sum(tl.reshape(p_rows, [BT, HGP, NBCP]), 1)
        t2 = tl.arange(0, BT)
        tpos = (t0 + t2).to(tl.int64)
        tl.store(P + (bh * (T1 - T0) + tpos[:, None] - T0) * NB + blk[None, :], p_pos,
                 mask=(tpos[:, None] < T1) & (bb[None, :] < NBC) & (blk[None, :] < NB))
    else:
        p_pos = tl.dot(E, p_rows, input_precision="ieee")
        ti = tl.arange(0, BTP)
        tpos = (t0 + ti).to(tl.int64)
        tl.store(P + (bh * (T1 - T0) + tpos[:, None] - T0) * NB + blk[None, :], p_pos,
                 mask=(ti[:, None] < BT) & (tpos[:, None] < T1) & (bb[None, :] < NBC) & (blk[None, :] < NB))


# the forced blocks' keys (the previous block, block 0, the current one: FORCED .. FORCED + 2), above every
# score (a probability sum's bits as int32 stay below 0x7F000000); the 64-bit keys carry them high
FORCED = tl.constexpr(0x7F000001)


@triton.jit
def _nth_below(key, below, R: tl.constexpr):
    """The ``R``-th largest key of each row below ``below`` (or the lowest there is): one max per round over
    the keys below the previous round's."""
    for _ in range(R):
        m = tl.max(tl.where(key < below[:, None], key, -1), 1)
        below = tl.where(m >= 0, m, below)
    return below


@triton.jit
def _rounds_below(key, forced, top, BR: tl.constexpr, N_SEL: tl.constexpr, SKIP: tl.constexpr):
    """The ``N_SEL``-th largest key of each row (unique keys), one max per round over the keys below the
    previous round's; the forced blocks (at most three, the highest keys) are skipped in one min."""
    below = tl.full([BR], top, key.dtype)
    if SKIP and N_SEL >= 3:
        below = tl.min(tl.where(key >= forced, key, top), 1)
    R: tl.constexpr = N_SEL - 3 if SKIP and N_SEL >= 3 else N_SEL  # rounds left
    return _nth_below(key, below, R)


@triton.jit
def _chosen64(key32, blk, t_ok, NBP: tl.constexpr, BR: tl.constexpr, N_SEL: tl.constexpr, SKIP: tl.constexpr):
    """The spec's choice: one unique 64-bit key per block, the score above and the reversed index below, so
    a round's max picks the highest score with ties to the lower index; the chosen blocks are exactly the
    valid keys at or above the n_sel-th (non-candidates are negative)."""
    key = (key32.to(tl.int64) << 32) | (NBP - 1 - blk)[None, :].to(tl.int64)
    below = _rounds_below(key, FORCED << 32, 0x7FFFFFFFFFFFFFFF, BR, N_SEL, SKIP)
    return (key >= below[:, None]) & (key >= 0) & t_ok[:, None]


@triton.jit
def _top_blocks_kernel(
    P, IDX, S, T0, T1, NB, H, Q0,
    LS: tl.constexpr, N_SEL: tl.constexpr, NBP: tl.constexpr, NSP: tl.constexpr, BR: tl.constexpr,
    SKIP: tl.constexpr, K32: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    g = bh % H
    t = T0 + pid * BR + tl.arange(0, BR)
    t_ok = t < T1
    t64 = t.to(tl.int64)
    blk = tl.arange(0, NBP)
    bt = (Q0 + t) // LS  # current block of row t (position Q0 + t)
    cand = (blk[None, :] <= bt[:, None]) & t_ok[:, None]
    pv = tl.load(P + (bh * (T1 - T0) + t64[:, None] - T0) * NB + blk[None, :], mask=cand, other=0.0)
    key32 = tl.maximum(pv.to(tl.int32, bitcast=True), 0)  # P >= 0: int order == float order
    key32 = tl.where(blk[None, :] == bt[:, None] - 1, FORCED, key32)
    key32 = tl.where(blk[None, :] == 0, FORCED + 1, key32)
    key32 = tl.where(blk[None, :] == bt[:, None], FORCED + 2, key32)
    key32 = tl.where(cand, key32, -1)
    if K32:
        # 32-bit rounds over the scores alone (the default; tile key topn_key=64 for the 64-bit keys only):
        # exact when no score repeats at or above the n_sel-th, i.e. when exactly n_sel keys are chosen
        below32 = _rounds_below(key32, FORCED, 0x7FFFFFFF, BR, N_SEL, SKIP)
        chosen = (key32 >= below32[:, None]) & (key32 >= 0) & t_ok[:, None]
        if tl.max(tl.sum(chosen.to(tl.int32), 1)) > N_SEL:
            # a tie there (rare: equal fp32 sums): the tile again with the index breaking it, as below
            chosen = _chosen64(key32, blk, t_ok, NBP, BR, N_SEL, SKIP)
    else:
        chosen = _chosen64(key32, blk, t_ok, NBP, BR, N_SEL, SKIP)
    # ascending output: each chosen block goes to the slot given by the number chosen below it
    n_chosen = tl.sum(chosen.to(tl.int32), 1)
    rank = tl.cumsum(chosen.to(tl.int32), 1) - 1
    row = ((b * S + t64) * H + g) * N_SEL
    ns = tl.arange(0, NSP)
    tl.store(IDX + row[:, None] + ns[None, :], tl.full([BR, NSP], -1, tl.int32),
             mask=t_ok[:, None] & (ns[None, :] < N_SEL) & (ns[None, :] >= n_chosen[:, None]))
    tl.store(IDX + row[:, None] + rank, (blk[None, :] + 0 * rank).to(tl.int32), mask=chosen)


def _block_scores(q: torch.Tensor, k_cmp: torch.Tensor, lse: torch.Tensor, P: torch.Tensor, t0: int, t1: int,
                  *, l: int, d: int, l_sel: int, scale: float, q_start: int = 0) -> None:  # noqa: E741
    """Group-summed block importance of query rows ``[t0, t1)`` (positions ``q_start + t``) into
    ``P [B*H, t1-t0, n_blocks]`` (fp32; entries past ``(q_start + t) // l_sel`` unset)."""
    B, S, HQ, DK = q.shape
    NK, H = k_cmp.shape[1], k_cmp.shape[2]
    h = HQ // H
    NB = P.shape[-1]
    cfg = tile_config(q.device, h, DK, DK, "score")
    halo = l // d - 1
    per_blk = l_sel // d
    bj = max(next_pow2(per_blk + halo), int(tuned("score_bj", 64)) if q.is_cuda else 16)
    nbc = (bj - halo) // per_blk
    # a group of h heads takes hp rows per position: padded to a power of two, the head sum is a reshape
    # instead of a product with a 0/1 matrix
    hp = next_pow2(h) if bool(tuned("score_pad", 1)) else h
    bt = cfg.bm // hp
    _block_scores_kernel[(triton.cdiv(t1 - t0, bt), B * H)](
        q, k_cmp, lse, P, *q.stride()[:3], *k_cmp.stride()[:3], S, t0, t1, NK, NB, HQ, q_start, scale * LOG2E,
        HG=h, HGP=hp, H=H, L=l, D=d, LS=l_sel, DK=DK, BDK=max(16, next_pow2(DK)), BM=cfg.bm, BJ=bj,
        NBC=nbc, NBCP=max(16, next_pow2(nbc)), BTP=max(16, next_pow2(bt)),
        PREC=str(tuned("score_prec", "fp16" if q.is_cuda else "ieee")),
        RESHAPE=bool(tuned("score_reshape", 1)) and q.is_cuda and hp & (hp - 1) == 0 and cfg.bm == bt * hp,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def top_blocks(P: torch.Tensor, idx: torch.Tensor, t0: int, t1: int, *, l_sel: int, q_start: int = 0) -> None:
    """Spec top-n over ``P`` (query rows ``[t0, t1)`` at positions ``q_start + t``) into
    ``idx [B, S, H, n_sel]``: ascending, ``-1`` padded."""
    B, S, H, n_sel = idx.shape
    NB = P.shape[-1]
    # the rows' candidates end at the slab's last block: keys for those only (causal: early slabs need few)
    nbp = max(16, next_pow2(min(NB, (q_start + t1 - 1) // l_sel + 1)))
    br = max(1, min(64, int(tuned("topn_elems", 1024)) // nbp))
    # a warp per 512 keys of a row (H200, 32-bit rounds: 1,024 keys 1 or 2 warps alike, 2,048 keys 4 warps 27%
    # faster than 1; the H100's sweep of the 64-bit keys at fewer keys had 1 warp first)
    warps = int(tuned("topn_warps", min(8, max(1, nbp // 512))))
    _top_blocks_kernel[(triton.cdiv(t1 - t0, br), B * H)](
        P, idx, S, t0, t1, NB, H, q_start, LS=l_sel, N_SEL=n_sel, NBP=nbp, NSP=max(2, next_pow2(n_sel)),
        BR=br, SKIP=bool(tuned("topn_forced", 1)),
        K32=int(tuned("topn_key", 32)) == 32, num_warps=warps,
    )


def select_top(
    q: torch.Tensor, k_cmp: torch.Tensor, lse: torch.Tensor, *, l: int, d: int, l_sel: int,  # noqa: E741
    n_sel: int, scale: float, q_start: int = 0,
) -> torch.Tensor:
    """Spec top-n blocks: int32 ``[B, S, H, n_sel]``, ascending, ``-1`` padded (row ``t`` at position
    ``q_start + t``; absolute block numbers).

    Positions go in slabs whose score matrix stays under about 128 MiB (scores, then top-n, per slab),
    so the memory of the whole ``[B*H, S, n_blocks]`` matrix (1 GiB at the paper shape, 64k) is never held."""
    B, S = q.shape[:2]
    H = k_cmp.shape[2]
    NB = -(-(q_start + S) // l_sel)
    idx = torch.empty(B, S, H, n_sel, device=q.device, dtype=torch.int32)
    slab = int(tuned("score_slab", max(1024, (128 << 20) // (B * H * NB * 4)) if q.is_cuda else S))
    P = torch.empty(B * H, min(S, slab), NB, device=q.device, dtype=torch.float32)
    for t0 in range(0, S, slab):
        t1 = min(S, t0 + slab)
        _block_scores(q, k_cmp, lse, P, t0, t1, l=l, d=d, l_sel=l_sel, scale=scale, q_start=q_start)
        top_blocks(P, idx, t0, t1, l_sel=l_sel, q_start=q_start)
    return idx
