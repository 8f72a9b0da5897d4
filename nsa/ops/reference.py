"""Plain reference of NSA attention: loops over batch, position and group, written to read like the spec.

This is the oracle of the tests (run it in float64). It is slow on purpose: every index set is built
explicitly, position by position, from the definitions of ``docs/nsa-semantics.md``, and it shares no
index helper with the fast paths (``nsa.ops.indexing``), so a mistake there cannot pass parity.
"""

from __future__ import annotations

import torch

from nsa.params import NSAParams


def _cmp_span(j: int, hp: NSAParams) -> range:
    """Raw positions pooled into compressed token ``j``: ``[j*d, j*d + l)``."""
    return range(j * hp.d, j * hp.d + hp.l)


def _visible_cmp(t: int, S: int, hp: NSAParams) -> list[int]:
    """Compressed tokens whose whole span lies at or before position ``t`` (and inside the sequence)."""
    out = []
    j = 0
    while j * hp.d + hp.l <= S:
        if max(_cmp_span(j, hp)) <= t:
            out.append(j)
        j += 1
    return out


def _block_span(b: int, hp: NSAParams) -> range:
    """Raw positions of selection block ``b``: ``[b*l_sel, (b+1)*l_sel)``."""
    return range(b * hp.l_sel, (b + 1) * hp.l_sel)


def _forced(t: int, l_sel: int) -> list[int]:
    """Forced blocks of query ``t`` in priority order: current, initial, previous (each once)."""
    bt = t // l_sel
    out: list[int] = []
    for b in (bt, 0, bt - 1):
        if 0 <= b <= bt and b not in out:
            out.append(b)
    return out


def compress_avg(x: torch.Tensor, hp: NSAParams) -> torch.Tensor:
    """Mean of raw rows ``[j*d, j*d+l)`` for each compressed token ``j``: ``[B, S_cmp, H, D]``."""
    B, S, H, D = x.shape
    rows = []
    j = 0
    while j * hp.d + hp.l <= S:
        span = _cmp_span(j, hp)
        rows.append(x[:, span.start : span.stop].mean(dim=1))
        j += 1
    if not rows:
        return x.new_zeros(B, 0, H, D)
    return torch.stack(rows, dim=1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of queries ``[h, Dk]`` over keys ``[n, Dk]``; zeros when ``n == 0``."""
    if k.shape[0] == 0:
        return q.new_zeros(q.shape[0], v.shape[-1])
    p = torch.softmax((q @ k.T) * scale, dim=-1)
    return p @ v


def _choose(P: list[float], t: int, l_sel: int, n_sel: int) -> list[int]:
    """Forced blocks first, then the highest ``P`` (ties to the lower index), sorted ascending."""
    bt = t // l_sel
    want = min(n_sel, bt + 1)
    chosen = _forced(t, l_sel)[:want]
    rest = sorted((b for b in range(bt + 1) if b not in chosen), key=lambda b: (-P[b], b))
    chosen += rest[: want - len(chosen)]
    return sorted(chosen)


def _check(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, S, heads, dim] with the "
                         "key heads dividing the query heads")
    B, S, HQ, _ = q.shape
    return B, S, HQ, k.shape[2]


def _positions(q_start: int, S_q: int, S_k: int | None) -> range:
    """Absolute positions of the query rows: ``q_start .. q_start + S_q - 1``, all inside the ``S_k`` keys."""
    if q_start < 0 or (S_k is not None and q_start + S_q > S_k):
        raise ValueError(f"q_start={q_start} with {S_q} query rows needs 0 <= q_start and q_start + S_q <= "
                         f"S_k={S_k} key positions")
    return range(q_start, q_start + S_q)


def select_blocks(q: torch.Tensor, k_cmp: torch.Tensor, hp: NSAParams, *, scale: float | None = None,
                  q_start: int = 0) -> torch.Tensor:
    """Top-``n_sel`` selection blocks per query and group: int32 ``[B, S_q, H, n_sel]``, -1 padded
    (query row ``i`` at position ``q_start + i``; absolute block numbers)."""
    B, S_q, HQ, H = _check(q, k_cmp)
    h = HQ // H
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    positions = _positions(q_start, S_q, None)
    S = q_start + S_q  # every visible token lies inside the keys up to the last query
    n_blocks = len(range(0, S, hp.l_sel))
    out = torch.full((B, S_q, H, hp.n_sel), -1, dtype=torch.int32, device=q.device)
    with torch.no_grad():
        for b in range(B):
            for i, t in enumerate(positions):
                vis = _visible_cmp(t, S, hp)
                for g in range(H):
                    P = [0.0] * n_blocks
                    if vis:
                        q_g = q[b, i, g * h : (g + 1) * h]
                        p = torch.softmax((q_g @ k_cmp[b, vis, g].T) * scale, dim=-1)
                        p_sum = p.sum(dim=0)  # group reduction (Eq. 10) of per-head Eq. 9 scores
                        for n, j in enumerate(vis):
                            span = set(_cmp_span(j, hp))
                            for blk in range(n_blocks):
                                shared = len(span.intersection(_block_span(blk, hp)))
                                if shared:
                                    P[blk] += float(p_sum[n]) * shared / hp.l
                    chosen = _choose(P, t, hp.l_sel, hp.n_sel)
                    out[b, i, g, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def nsa_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    hp: NSAParams,
    *,
    scale: float | None = None,
    block_idx: torch.Tensor | None = None,
    return_block_idx: bool = False,
    q_start: int = 0,
    q_win: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """NSA output ``g_cmp * o_cmp + g_sel * o_sel + g_win * o_win``: ``[B, S_q, HQ, Dv]`` for the query
    rows at positions ``q_start .. q_start + S_q - 1`` against the keys of positions ``0 .. S_k - 1``.
    ``q_win``: the window branch's own queries (``q``'s shape; ``None``: ``q``)."""
    B, S_q, HQ, H = _check(q, k_sel)
    q_w = q if q_win is None else q_win
    S = k_sel.shape[1]
    h = HQ // H
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    positions = _positions(q_start, S_q, S)
    if block_idx is None:
        block_idx = select_blocks(q, k_cmp, hp, scale=scale, q_start=q_start)
    rows = []
    for b in range(B):
        per_t = []
        for i, t in enumerate(positions):
            vis = _visible_cmp(t, S, hp)
            per_g = []
            for g in range(H):
                heads = slice(g * h, (g + 1) * h)
                q_g = q[b, i, heads]
                o_cmp = _attend(q_g, k_cmp[b, vis, g], v_cmp[b, vis, g], scale)
                blocks = [int(x) for x in block_idx[b, i, g] if int(x) >= 0]
                pos = sorted({p for blk in blocks for p in _block_span(blk, hp) if p <= t})
                idx = torch.tensor(pos, dtype=torch.long, device=q.device)
                o_sel = _attend(q_g, k_sel[b, idx, g], v_sel[b, idx, g], scale)
                win = [p for p in range(t + 1) if t - p < hp.w]
                o_win = _attend(q_w[b, i, heads], k_win[b, win, g], v_win[b, win, g], scale)
                g_t = gates[b, i, heads]
                per_g.append(g_t[:, 0:1] * o_cmp + g_t[:, 1:2] * o_sel + g_t[:, 2:3] * o_win)
            per_t.append(torch.cat(per_g, dim=0))
        rows.append(torch.stack(per_t, dim=0))
    out = torch.stack(rows, dim=0)
    return (out, block_idx) if return_block_idx else out
