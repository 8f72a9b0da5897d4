"""The FSA order's work list built by three Triton launches instead of ~25 PyTorch operators.

:func:`nsa.ops._triton.selection.work_list` sorts each row's ``(position, slot)`` pairs by chosen block
(stable) and cuts every block's pairs into work items; on the device as PyTorch operators that is a permute, a
cast, a
``where``, a stable sort, a scatter-add, two cumulative sums, a search, three gathers, a stack and a
concatenation: about 45 kernel launches and 1 ms of host time a call (m7c 2k, H200; docs/kernels.md), as long
as the call's own kernels take at that size once no CUDA graph replays it. Here the same list, bit for bit, is
a counting sort:

1. ``_hist_kernel`` (a program per row and segment of ``SEG`` pairs): each segment's histogram of blocks;
2. ``_scan_kernel`` (a program per row): each segment's first slot per block (prefix sums over the blocks,
then
   over the segments), and the work items ``(block, first, end)`` from the totals;
3. ``_scatter_kernel`` (a program per row and segment): each pair to its slot, ties in pair order (a pair's
   rank among its chunk's pairs of the same block, from a cumulative sum of the chunk's one-hot matrix).

Blocks are counted in one-hot tiles of ``NBP`` bins (the block count plus one for "none", to a power of two),
so this serves up to :data:`MAX_BINS` bins (``l_sel = 64``: 16k positions); longer lists are built by
:func:`build_sorted` (segment histograms and sorts, below). The default (tile key ``sel_wl``: ``kernel``;
``sort`` for the sorts at every length, ``ops`` for the operators); a Triton that cannot compile these kernels
falls back to the operators once, counted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nsa.ops._triton import next_pow2
from nsa.ops.fallbacks import FirstLaunch

MAX_BINS = 256  # blocks + 1, to a power of two: one-hot tiles of C x NBP stay at 8,192 elements
SEG = 1024  # pairs per segment (a program of the histogram and scatter passes)
# the sorts' segment histograms grow as S**2 (segments x blocks): past this the operators (memory linear in S)
# build the list (paper shape: 134 MiB at 128k, 537 MiB at 256k)
SORT_HIST_BYTES = 256 * 2**20


@triton.jit
def _keys(IDX, b, g, p, m, s_b, s_s, s_h, s_n, NSEL: tl.constexpr, NB):
    """Chosen block of pairs ``p`` (``pos * NSEL + slot``) of row ``(b, g)``; ``NB`` for none (``-1``)."""
    pos = p // NSEL
    v = tl.load(IDX + b * s_b + pos * s_s + g * s_h + (p % NSEL) * s_n, mask=m, other=0)
    return tl.where(v < 0, NB, v)


@triton.jit
def _hist_kernel(IDX, HIST, s_b, s_s, s_h, s_n, H, SN, NB, NSEG,
                 NSEL: tl.constexpr, SEG: tl.constexpr, C: tl.constexpr, NBP: tl.constexpr):
    r = tl.program_id(0)
    sg = tl.program_id(1)
    b, g = r // H, r % H
    bins = tl.arange(0, NBP)
    acc = tl.zeros([NBP], dtype=tl.int32)
    for c0 in range(0, SEG, C):
        p = sg * SEG + c0 + tl.arange(0, C)
        m = p < SN
        k = _keys(IDX, b, g, p, m, s_b, s_s, s_h, s_n, NSEL, NB)
        acc += tl.sum(((k[:, None] == bins[None, :]) & m[:, None]).to(tl.int32), axis=0)
    tl.store(HIST + (r * NSEG + sg) * NBP + bins, acc)


@triton.jit
def _segment_bases(HIST, r, NB, NSEG, CH, NBP: tl.constexpr):
    """Row ``r``'s histograms ``HIST[r, segment, bin]`` replaced by each segment's first slot per block;
    returns every block's first slot ("none" last: the largest key), its pair count (0 for "none" and past
    it) and its work items of at most ``CH`` pairs."""
    bins = tl.arange(0, NBP)
    tot = tl.zeros([NBP], dtype=tl.int32)
    for sg in range(0, NSEG):
        tot += tl.load(HIST + (r * NSEG + sg) * NBP + bins)
    starts = tl.cumsum(tot, 0) - tot
    run = starts
    for sg in range(0, NSEG):
        h = tl.load(HIST + (r * NSEG + sg) * NBP + bins)
        tl.store(HIST + (r * NSEG + sg) * NBP + bins, run)
        run += h
    cnt = tl.where(bins < NB, tot, 0)
    return starts, cnt, (cnt + CH - 1) // CH


@triton.jit
def _items(base, w, blk, start, cnt, j, CH, m):
    """Work items ``w`` (at ``base``, three int32 each): block ``blk``'s pairs from ``start + j*CH``, at most
    ``CH`` of them and none past ``start + cnt``."""
    first = start + j * CH
    tl.store(base + 3 * w, blk, mask=m)
    tl.store(base + 3 * w + 1, first, mask=m)
    tl.store(base + 3 * w + 2, tl.minimum(start + cnt, first + CH), mask=m)


@triton.jit
def _at(values, sel):
    """The one entry of ``values`` where ``sel`` holds."""
    return tl.sum(tl.where(sel, values, 0), 0)


@triton.jit
def _scan_kernel(HIST, OUT, W, SN, NB, NSEG, NW, CH,
                 NBP: tl.constexpr, CW: tl.constexpr):
    r = tl.program_id(0)
    bins = tl.arange(0, NBP)
    starts, cnt, nch = _segment_bases(HIST, r, NB, NSEG, CH, NBP)
    valid = bins < NB
    cum = tl.cumsum(nch, 0)
    excl = cum - nch
    for w0 in range(0, NW, CW):
        w = w0 + tl.arange(0, CW)
        mw = w < NW
        blk = tl.sum(((cum[None, :] <= w[:, None]) & valid[None, :]).to(tl.int32), axis=1)
        wb = tl.minimum(blk, NB - 1)
        sel = bins[None, :] == wb[:, None]
        st = tl.sum(tl.where(sel, starts[None, :], 0), axis=1)
        ex = tl.sum(tl.where(sel, excl[None, :], 0), axis=1)
        ct = tl.sum(tl.where(sel, cnt[None, :], 0), axis=1)
        _items(OUT + r * W + SN, w, blk, st, ct, w - ex, CH, mw)


@triton.jit
def _scatter_kernel(IDX, HIST, OUT, s_b, s_s, s_h, s_n, H, W, SN, NB, NSEG,
                    NSEL: tl.constexpr, SEG: tl.constexpr, C: tl.constexpr, NBP: tl.constexpr):
    r = tl.program_id(0)
    sg = tl.program_id(1)
    b, g = r // H, r % H
    bins = tl.arange(0, NBP)
    run = tl.load(HIST + (r * NSEG + sg) * NBP + bins)
    for c0 in range(0, SEG, C):
        p = sg * SEG + c0 + tl.arange(0, C)
        m = p < SN
        k = _keys(IDX, b, g, p, m, s_b, s_s, s_h, s_n, NSEL, NB)
        oh = ((k[:, None] == bins[None, :]) & m[:, None]).to(tl.int32)
        rank = tl.sum(tl.cumsum(oh, 0) * oh, axis=1) - 1  # earlier pairs of this chunk with the same block
        slot = tl.sum(oh * run[None, :], axis=1) + rank
        tl.store(OUT + r * W + slot, p, mask=m)
        run += tl.sum(oh, axis=0)


# Any number of blocks (the default past the one-hot bins; tile key ``sel_wl=sort`` everywhere): per segment
# a histogram (``tl.histogram``) and a sort of the segment's (block, pair) keys (``tl.sort``), so no one-hot
# tile grows with the block count; the work items written block by block. The same list, bit for bit.


@triton.jit
def _seg_keys(IDX, b, g, sg, s_b, s_s, s_h, s_n, SN, NB, NSEL: tl.constexpr, SEG: tl.constexpr,
              SPARE: tl.constexpr):
    """A segment's chosen blocks (``NB`` for none); pairs past the row's end in a bin of their own,
    ``SPARE``."""
    p = sg * SEG + tl.arange(0, SEG)
    m = p < SN
    return tl.where(m, _keys(IDX, b, g, p, m, s_b, s_s, s_h, s_n, NSEL, NB), SPARE)


@triton.jit
def _hist_sorted_kernel(IDX, HIST, s_b, s_s, s_h, s_n, H, SN, NB, NSEG,
                        NSEL: tl.constexpr, SEG: tl.constexpr, NBP: tl.constexpr):
    r = tl.program_id(0)
    sg = tl.program_id(1)
    k = _seg_keys(IDX, r // H, r % H, sg, s_b, s_s, s_h, s_n, SN, NB, NSEL, SEG, NBP - 1)
    tl.store(HIST + (r * NSEG + sg) * NBP + tl.arange(0, NBP), tl.histogram(k, NBP))


@triton.jit
def _segment_prefix_kernel(HIST, TOT, NSEG, NBP: tl.constexpr, BT: tl.constexpr, SGT: tl.constexpr):
    """A program per row and tile of ``BT`` bins: ``HIST[r, segment, bin]`` replaced by the pairs of that bin
    in the row's earlier segments (tiles of ``SGT`` segments at a time), ``TOT[r, bin]`` the row's total."""
    r = tl.program_id(0)
    bins = tl.program_id(1) * BT + tl.arange(0, BT)
    run = tl.zeros([BT], dtype=tl.int32)
    for s0 in range(0, NSEG, SGT):
        sg = s0 + tl.arange(0, SGT)
        m = (sg < NSEG)[:, None]
        ptr = HIST + (r * NSEG + sg[:, None]).to(tl.int64) * NBP + bins[None, :]
        h = tl.load(ptr, mask=m, other=0)
        tl.store(ptr, run[None, :] + tl.cumsum(h, 0) - h, mask=m)
        run += tl.sum(h, 0)
    tl.store(TOT + r * NBP + bins, run)


@triton.jit
def _scan_by_block_kernel(TOT, OUT, W, SN, NB, NW, CH, NBP: tl.constexpr, FW: tl.constexpr):
    """Every block's first slot (in place of its total), then the work items block by block: item
    ``excl[b] + j`` holds pairs ``starts[b] + j*CH ..`` of block ``b``; items past the last take block
    ``NB`` and the arithmetic of block ``NB - 1`` (as the operators' search gives them). Every block's items
    up to the second-largest count go out a pass each over the blocks; the largest block's rest (block 0,
    which every position chooses: ``S / CH`` items) ``FW`` at a time."""
    r = tl.program_id(0)
    bins = tl.arange(0, NBP)
    tot = tl.load(TOT + r * NBP + bins)
    starts = tl.cumsum(tot, 0) - tot
    tl.store(TOT + r * NBP + bins, starts)
    valid = bins < NB
    cnt = tl.where(valid, tot, 0)
    nch = (cnt + CH - 1) // CH
    excl = tl.cumsum(nch, 0) - nch
    base = OUT + r * W + SN
    top = tl.argmax(nch, 0)
    second = tl.max(tl.where(bins == top, 0, nch), 0)
    for j in range(0, second):
        _items(base, excl + j, bins, starts, cnt, j, CH, valid & (j < nch))
    is_top = bins == top
    t_start, t_excl, t_cnt, most = _at(starts, is_top), _at(excl, is_top), _at(cnt, is_top), tl.max(nch, 0)
    for j0 in range(second, most, FW):  # (a name apart from the loop above's scalar ``j``: Triton types it)
        jv = j0 + tl.arange(0, FW)
        _items(base, t_excl + jv, tl.full([FW], 0, tl.int32) + top, t_start, t_cnt, jv, CH, jv < most)
    last = bins == NB - 1
    l_start, l_excl, l_cnt = _at(starts, last), _at(excl, last), _at(cnt, last)
    for w0 in range(tl.sum(nch, 0), NW, FW):
        w = w0 + tl.arange(0, FW)
        _items(base, w, tl.full([FW], 0, tl.int32) + NB, l_start, l_cnt, w - l_excl, CH, w < NW)


@triton.jit
def _scatter_sorted_kernel(IDX, HIST, TOT, OUT, s_b, s_s, s_h, s_n, H, W, SN, NB, NSEG,
                           NSEL: tl.constexpr, SEG: tl.constexpr, NBP: tl.constexpr):
    """Each pair of a segment to its slot: its block's first slot, plus the block's pairs in earlier segments,
    plus its rank among the segment's pairs of that block (its place in the segment's sorted order of
    ``block * SEG + pair`` less the segment's pairs of lower blocks)."""
    r = tl.program_id(0)
    sg = tl.program_id(1)
    bins = tl.arange(0, NBP)
    k = _seg_keys(IDX, r // H, r % H, sg, s_b, s_s, s_h, s_n, SN, NB, NSEL, SEG, NBP - 1)
    h = tl.histogram(k, NBP)
    loc = tl.arange(0, SEG)
    s = tl.sort(k * SEG + loc)
    kb = s // SEG
    earlier = tl.load(HIST + (r * NSEG + sg) * NBP + bins)  # the block's pairs in earlier segments
    base = tl.load(TOT + r * NBP + bins) + earlier - (tl.cumsum(h, 0) - h)
    slot = tl.gather(base, kb, 0) + loc
    tl.store(OUT + r * W + slot, sg * SEG + s - kb * SEG, mask=kb < NBP - 1)


def fits(n_blocks: int) -> bool:
    """Whether these kernels serve a list of ``n_blocks`` blocks (plus "none")."""
    return next_pow2(n_blocks + 1) <= MAX_BINS


def sorted_fits(rows: int, pairs: int, n_blocks: int) -> bool:
    """Whether :func:`build_sorted`'s segment histograms for ``rows`` rows of ``pairs`` pairs over
    ``n_blocks`` blocks stay within :data:`SORT_HIST_BYTES`."""
    return rows * -(-pairs // SEG) * max(16, next_pow2(n_blocks + 2)) * 4 <= SORT_HIST_BYTES


def build_sorted(idx: torch.Tensor, n_blocks: int, pairs_per_item: int, width: int) -> torch.Tensor:
    """:func:`build`'s list for any number of blocks, in four launches: segment histograms, their prefix over
    the segments (a program per tile of bins), the blocks' first slots and the work items, the sorts."""
    B, S, H, n = idx.shape
    rows, sn = B * H, S * n
    nbp = max(16, next_pow2(n_blocks + 2))  # the blocks, "none" and the spare bin of pairs past the end
    nseg = -(-sn // SEG)
    hist = torch.empty(rows, nseg, nbp, device=idx.device, dtype=torch.int32)
    tot = torch.empty(rows, nbp, device=idx.device, dtype=torch.int32)
    out = torch.empty(rows, width, device=idx.device, dtype=torch.int32)
    st = idx.stride()
    if rows == 0 or sn == 0:
        return out
    _hist_sorted_kernel[(rows, nseg)](idx, hist, *st[:3], st[3], H, sn, n_blocks, nseg, NSEL=n, SEG=SEG,
                                      NBP=nbp)
    bt = min(nbp, 128)
    _segment_prefix_kernel[(rows, nbp // bt)](hist, tot, nseg, NBP=nbp, BT=bt, SGT=32)
    _scan_by_block_kernel[(rows,)](tot, out, width, sn, n_blocks, (width - sn) // 3, pairs_per_item, NBP=nbp,
                                   FW=128)
    _scatter_sorted_kernel[(rows, nseg)](idx, hist, tot, out, *st[:3], st[3], H, width, sn, n_blocks, nseg,
                                         NSEL=n, SEG=SEG, NBP=nbp)
    return out


# the first build of the process is guarded: a Triton that cannot compile these kernels leaves the operators
# in charge
FIRST_BUILD = FirstLaunch("work_list:kernels->operators")
FIRST_SORTED = FirstLaunch("work_list:sort->operators")


def build(idx: torch.Tensor, n_blocks: int, pairs_per_item: int, width: int) -> torch.Tensor:
    """:func:`nsa.ops._triton.selection.work_list`'s tensor ``[B*H, width]`` (int32) for the block lists
    ``idx``
    ``[B, S, H, n]`` over ``n_blocks`` blocks, work items of at most ``pairs_per_item`` pairs."""
    B, S, H, n = idx.shape
    rows, sn = B * H, S * n
    nbp = max(16, next_pow2(n_blocks + 1))
    nseg = -(-sn // SEG)
    c = max(16, 8192 // nbp)
    hist = torch.empty(rows, nseg, nbp, device=idx.device, dtype=torch.int32)
    out = torch.empty(rows, width, device=idx.device, dtype=torch.int32)
    st = idx.stride()
    if rows == 0 or sn == 0:
        return out
    _hist_kernel[(rows, nseg)](idx, hist, *st[:3], st[3], H, sn, n_blocks, nseg, NSEL=n, SEG=SEG, C=c,
                               NBP=nbp)
    nw = (width - sn) // 3
    _scan_kernel[(rows,)](hist, out, width, sn, n_blocks, nseg, nw, pairs_per_item, NBP=nbp,
                          CW=max(16, min(128, 8192 // nbp)))
    _scatter_kernel[(rows, nseg)](idx, hist, out, *st[:3], st[3], H, width, sn, n_blocks, nseg, NSEL=n,
                                  SEG=SEG, C=c, NBP=nbp)
    return out
