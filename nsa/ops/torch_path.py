"""Vectorised PyTorch NSA: the default on CPU and the fallback wherever no kernel serves a call.

Queries are processed in chunks so memory stays bounded; within a chunk each branch is one masked
attention over exactly the spec's key set (built as a boolean mask, never a wider set). All heads of a
group share keys and the selection mask, so a group's ``h`` heads are folded into the query-row axis.
Rows with no visible key give zeros (compressed branch at early positions), never NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nsa.ops.indexing import (
    check_cmp_tokens,
    check_q_start,
    check_shapes,
    masked_softmax,
    num_cmp,
    overlap_weights,
    top_n_blocks,
    visible_cmp_counts,
)
from nsa.params import NSAParams

# Elements of one chunk's score matrix (rows x keys); bounds the working set of a chunk.
CHUNK_ELEMENTS = 1 << 25


def compress_avg(x: torch.Tensor, hp: NSAParams) -> torch.Tensor:
    """Mean of raw rows ``[j*d, j*d+l)`` for each compressed token ``j``: ``[B, S_cmp, H, D]``."""
    B, S, H, D = x.shape
    n = num_cmp(S, hp.l, hp.d)
    if n == 0:
        return x.new_zeros(B, 0, H, D)
    return x.unfold(1, hp.l, hp.d).mean(dim=-1)  # [B, n, H, D, l] -> [B, n, H, D]


def _fold(x: torch.Tensor, H: int) -> torch.Tensor:
    """``[B, C, H*h, D] -> [B, H, h*C, D]`` (heads of a group become query rows)."""
    B, C, HQ, D = x.shape
    h = HQ // H
    return x.reshape(B, C, H, h, D).permute(0, 2, 3, 1, 4).reshape(B, H, h * C, D)


def _unfold(x: torch.Tensor, h: int) -> torch.Tensor:
    """``[B, H, h*C, D] -> [B, C, H*h, D]``."""
    B, H, R, D = x.shape
    C = R // h
    return x.reshape(B, H, h, C, D).permute(0, 3, 1, 2, 4).reshape(B, C, H * h, D)


def _rows(mask: torch.Tensor, h: int) -> torch.Tensor:
    """Repeat a per-query mask ``[B|1, H|1, C, K]`` for the ``h`` heads folded into the rows."""
    B, H, C, K = mask.shape
    return mask[:, :, None].expand(B, H, h, C, K).reshape(B, H, h * C, K)


def _top_blocks(P: torch.Tensor, t: torch.Tensor, l_sel: int, n_sel: int) -> torch.Tensor:
    """``P [B, H, C, nb]`` block importance, ``t [C]`` positions -> int32 ``[B, C, H, n_sel]``."""
    return top_n_blocks(P, (t // l_sel)[:, None], n_sel).permute(0, 2, 1, 3)


def _chunk(S: int, rows_per_query: int, keys: int) -> int:
    return max(1, min(S, CHUNK_ELEMENTS // max(1, rows_per_query * max(keys, 1))))


def _cmp_chunk(
    q_rows: torch.Tensor,
    k_cmp_t: torch.Tensor,
    v_cmp_t: torch.Tensor | None,
    n_vis: torch.Tensor,
    scale: float,
    h: int,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Compressed branch of one chunk: output rows (if ``v_cmp_t``) and group-summed probabilities."""
    n = k_cmp_t.shape[2]
    vis = torch.arange(n, device=q_rows.device)[None, :] < n_vis[:, None]  # [C, n]
    mask = _rows(vis[None, None], h)
    p = masked_softmax(torch.matmul(q_rows, k_cmp_t.transpose(-1, -2)) * scale, mask)
    o = torch.matmul(p, v_cmp_t) if v_cmp_t is not None else None
    B, H = q_rows.shape[:2]
    C = vis.shape[0]
    p_group = p.detach().reshape(B, H, h, C, n).sum(dim=2)
    return o, p_group


def select_blocks(q: torch.Tensor, k_cmp: torch.Tensor, hp: NSAParams, *, scale: float | None = None,
                  q_start: int = 0) -> torch.Tensor:
    """Top-``n_sel`` selection blocks per query and group: int32 ``[B, S_q, H, n_sel]``, -1 padded (query
    row ``i`` at position ``q_start + i``; absolute block numbers)."""
    l, d, l_sel, n_sel = hp.l, hp.d, hp.l_sel, hp.n_sel  # noqa: E741
    B, S_q, HQ, Dk = q.shape
    check_q_start(q_start, S_q)
    check_cmp_tokens(k_cmp.shape[1], q_start, S_q, l, d)
    S = q_start + S_q  # positions up to the last query: every visible token and candidate block
    H = k_cmp.shape[2]
    h = HQ // H
    scale = Dk**-0.5 if scale is None else scale
    nb = -(-S // l_sel)
    n_all = k_cmp.shape[1]
    W = overlap_weights(n_all, nb, l, d, l_sel, dtype=q.dtype if q.dtype == torch.float64 else torch.float32,
                        device=q.device)
    k_t = k_cmp.permute(0, 2, 1, 3)
    n_vis_all = visible_cmp_counts(S, l, d, device=q.device)[q_start:]
    out = []
    with torch.no_grad():
        C = _chunk(S_q, HQ * B, n_all)
        for c0 in range(0, S_q, C):
            c1 = min(S_q, c0 + C)
            t = torch.arange(q_start + c0, q_start + c1, device=q.device)
            q_rows = _fold(q[:, c0:c1], H)
            _, p_group = _cmp_chunk(q_rows, k_t, None, n_vis_all[c0:c1], scale, h)
            P = torch.matmul(p_group.to(W.dtype), W)
            out.append(_top_blocks(P, t, l_sel, n_sel))
    return torch.cat(out, dim=1)


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
    l, d, l_sel, n_sel, w = hp.l, hp.d, hp.l_sel, hp.n_sel, hp.w  # noqa: E741
    B, S_q, S, HQ, H, h = check_shapes(q, k_sel, name="k_sel", q_start=q_start)
    check_cmp_tokens(k_cmp.shape[1], q_start, S_q, l, d)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dev = q.device
    nb = -(-S // l_sel)
    n_all = k_cmp.shape[1]
    W = overlap_weights(n_all, nb, l, d, l_sel,
                        dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=dev)
    kc, vc = k_cmp.permute(0, 2, 1, 3), v_cmp.permute(0, 2, 1, 3)
    ks, vs = k_sel.permute(0, 2, 1, 3), v_sel.permute(0, 2, 1, 3)
    kw, vw = k_win.permute(0, 2, 1, 3), v_win.permute(0, 2, 1, 3)
    n_vis_all = visible_cmp_counts(S, l, d, device=dev)
    key_block = torch.arange(S, device=dev) // l_sel
    outs, idx_chunks = [], []
    C = _chunk(S_q, HQ * B, S)
    for r0 in range(0, S_q, C):
        r1 = min(S_q, r0 + C)  # query rows r0..r1-1 sit at positions c0..c1-1
        c0, c1 = q_start + r0, q_start + r1
        t = torch.arange(c0, c1, device=dev)
        q_rows = _fold(q[:, r0:r1], H)

        # compressed branch (and the probabilities that score the selection blocks)
        o_cmp, p_group = _cmp_chunk(q_rows, kc, vc, n_vis_all[c0:c1], scale, h)
        assert o_cmp is not None
        if block_idx is None:
            P = torch.matmul(p_group.to(W.dtype), W)
            idx = _top_blocks(P, t, l_sel, n_sel)
        else:
            idx = block_idx[:, r0:r1].to(torch.int64)
        idx_chunks.append(idx.to(torch.int32))

        # selected branch: keys 0..c1-1 in a chosen block and not after the query
        chosen = torch.zeros(B, H, c1 - c0, nb + 1, dtype=torch.bool, device=dev)
        slot = torch.where(idx >= 0, idx, torch.full_like(idx, nb)).to(torch.int64).permute(0, 2, 1, 3)
        chosen.scatter_(-1, slot, True)
        causal = torch.arange(c1, device=dev)[None, :] <= t[:, None]  # [C, c1]
        sel_mask = chosen[..., :nb].index_select(-1, key_block[:c1]) & causal
        o_sel = F.scaled_dot_product_attention(
            q_rows, ks[:, :, :c1], vs[:, :, :c1], attn_mask=_rows(sel_mask, h), scale=scale
        )

        # sliding window: keys max(0, t-w+1) .. t
        k0 = max(0, c0 - w + 1)
        kpos = torch.arange(k0, c1, device=dev)[None, :]
        win_mask = (kpos <= t[:, None]) & (kpos > t[:, None] - w)
        q_w = q_rows if q_win is None else _fold(q_win[:, r0:r1], H)
        o_win = F.scaled_dot_product_attention(
            q_w, kw[:, :, k0:c1], vw[:, :, k0:c1], attn_mask=_rows(win_mask[None, None], h), scale=scale
        )

        g = gates[:, r0:r1]
        outs.append(
            g[..., 0:1] * _unfold(o_cmp, h) + g[..., 1:2] * _unfold(o_sel, h) + g[..., 2:3]
                    * _unfold(o_win, h)
        )
    out = torch.cat(outs, dim=1)
    if return_block_idx:
        return out, (block_idx if block_idx is not None else torch.cat(idx_chunks, dim=1))
    return out
