"""Plain reference of NSA attention: loops over batch, position and group, written to read like the spec.

This is the oracle of the tests (run it in float64). It is slow on purpose: every index set is built
explicitly, so what each query reads can be checked by eye against ``docs/nsa-semantics.md``.
"""

from __future__ import annotations

import torch

from nsa.ops.indexing import check_hparams, check_shapes, forced_blocks, num_cmp, num_visible_cmp, overlap


def compress_avg(x: torch.Tensor, l: int, d: int) -> torch.Tensor:  # noqa: E741
    """Mean of raw rows ``[j*d, j*d+l)`` for each compressed token ``j``: ``[B, S_cmp, H, D]``."""
    B, S, H, D = x.shape
    n = num_cmp(S, l, d)
    if n == 0:
        return x.new_zeros(B, 0, H, D)
    return torch.stack([x[:, j * d : j * d + l].mean(dim=1) for j in range(n)], dim=1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of queries ``[h, Dk]`` over keys ``[n, Dk]``; zeros when ``n == 0``."""
    if k.shape[0] == 0:
        return q.new_zeros(q.shape[0], v.shape[-1])
    p = torch.softmax((q @ k.T) * scale, dim=-1)
    return p @ v


def _cmp_probs(q_g: torch.Tensor, k_cmp_g: torch.Tensor, n_vis: int, scale: float) -> torch.Tensor:
    """Compressed-branch probabilities ``[h, n_vis]`` over the visible tokens only."""
    if n_vis == 0:
        return q_g.new_zeros(q_g.shape[0], 0)
    return torch.softmax((q_g @ k_cmp_g[:n_vis].T) * scale, dim=-1)


def _choose(P: list[float], t: int, l_sel: int, n_sel: int) -> list[int]:
    """Forced blocks first, then the highest ``P`` (ties to the lower index), sorted ascending."""
    bt = t // l_sel
    want = min(n_sel, bt + 1)
    chosen = forced_blocks(t, l_sel)[:want]
    rest = sorted((b for b in range(bt + 1) if b not in chosen), key=lambda b: (-P[b], b))
    chosen += rest[: want - len(chosen)]
    return sorted(chosen)


def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    *,
    l: int,  # noqa: E741
    d: int,
    l_sel: int,
    n_sel: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Top-``n_sel`` selection blocks per query and group: int32 ``[B, S, H, n_sel]``, -1 padded."""
    check_hparams(l, d, l_sel, n_sel)
    B, S, HQ, Dk = q.shape
    H = k_cmp.shape[2]
    h = HQ // H
    scale = Dk**-0.5 if scale is None else scale
    n_blocks = -(-S // l_sel)
    out = torch.full((B, S, H, n_sel), -1, dtype=torch.int32, device=q.device)
    with torch.no_grad():
        for b in range(B):
            for t in range(S):
                n_vis = num_visible_cmp(t, l, d)
                for g in range(H):
                    p = _cmp_probs(q[b, t, g * h : (g + 1) * h], k_cmp[b, :, g], n_vis, scale)
                    p_sum = p.sum(dim=0)  # group reduction (Eq. 10) of per-head Eq. 9 scores
                    P = [0.0] * n_blocks
                    for j in range(n_vis):
                        for blk in range(j * d // l_sel, (j * d + l - 1) // l_sel + 1):
                            P[blk] += float(p_sum[j]) * overlap(j, blk, l, d, l_sel) / l
                    chosen = _choose(P, t, l_sel, n_sel)
                    out[b, t, g, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
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
    *,
    l: int,  # noqa: E741
    d: int,
    l_sel: int,
    n_sel: int,
    w: int,
    scale: float | None = None,
    block_idx: torch.Tensor | None = None,
    return_block_idx: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """NSA output ``g_cmp * o_cmp + g_sel * o_sel + g_win * o_win``: ``[B, S, HQ, Dv]``."""
    check_hparams(l, d, l_sel, n_sel, w)
    B, S, _HQ, H, h = check_shapes(q, k_sel, name="k_sel")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if block_idx is None:
        block_idx = select_blocks(q, k_cmp, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=scale)
    rows = []
    for b in range(B):
        per_t = []
        for t in range(S):
            n_vis = num_visible_cmp(t, l, d)
            per_g = []
            for g in range(H):
                heads = slice(g * h, (g + 1) * h)
                q_g = q[b, t, heads]
                o_cmp = _attend(q_g, k_cmp[b, :n_vis, g], v_cmp[b, :n_vis, g], scale)
                blocks = [int(x) for x in block_idx[b, t, g] if int(x) >= 0]
                pos = sorted({p for blk in blocks for p in range(blk * l_sel, min((blk + 1) * l_sel, t + 1))})
                idx = torch.tensor(pos, dtype=torch.long, device=q.device)
                o_sel = _attend(q_g, k_sel[b, idx, g], v_sel[b, idx, g], scale)
                lo = max(0, t - w + 1)
                o_win = _attend(q_g, k_win[b, lo : t + 1, g], v_win[b, lo : t + 1, g], scale)
                g_t = gates[b, t, heads]
                per_g.append(g_t[:, 0:1] * o_cmp + g_t[:, 1:2] * o_sel + g_t[:, 2:3] * o_win)
            per_t.append(torch.cat(per_g, dim=0))
        rows.append(torch.stack(per_t, dim=0))
    out = torch.stack(rows, dim=0)
    return (out, block_idx) if return_block_idx else out
