"""Index arithmetic shared by every NSA path (the formulas of the spec, in one place)."""

from __future__ import annotations

import torch


def num_cmp(S: int, l: int, d: int) -> int:  # noqa: E741
    """Compressed tokens of a length-``S`` sequence: ``max(0, floor((S - l) / d) + 1)``."""
    return max(0, (S - l) // d + 1)


def num_visible_cmp(t: int, l: int, d: int) -> int:  # noqa: E741
    """Compressed tokens visible to the query at position ``t`` (last raw position ``<= t``)."""
    return max(0, (t + 1 - l) // d + 1)


def visible_cmp(t: torch.Tensor, l: int, d: int) -> torch.Tensor:  # noqa: E741
    """``N_c(t) = max(0, floor((t + 1 - l) / d) + 1)`` elementwise (int64)."""
    return torch.clamp(torch.div(t + 1 - l, d, rounding_mode="floor") + 1, min=0)


def visible_cmp_counts(S: int, l: int, d: int,  # noqa: E741
                       device: torch.device | str | None = None) -> torch.Tensor:
    """``N_c(t)`` for ``t = 0 .. S-1`` as an int64 tensor."""
    return visible_cmp(torch.arange(S, device=device), l, d)


def overlap(j: int, b: int, l: int, d: int, l_sel: int) -> int:  # noqa: E741
    """Raw positions shared by compressed token ``j`` ([j*d, j*d+l)) and selection block ``b``."""
    lo = max(j * d, b * l_sel)
    hi = min(j * d + l, (b + 1) * l_sel)
    return max(0, hi - lo)


def overlap_weights(
    n_cmp: int,
    n_blocks: int,
    l: int,  # noqa: E741
    d: int,
    l_sel: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``W[j, b] = overlap(j, b) / l``: block importance is ``p_cmp @ W`` (spec Eq. 9)."""
    j = torch.arange(n_cmp, device=device)[:, None]
    b = torch.arange(n_blocks, device=device)[None, :]
    lo = torch.maximum(j * d, b * l_sel)
    hi = torch.minimum(j * d + l, (b + 1) * l_sel)
    return (hi - lo).clamp(min=0).to(dtype) / l


def cmp_block_table(n_cmp: int, n_blocks: int, l: int, d: int, l_sel: int,  # noqa: E741
                    device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse form of :func:`overlap_weights`: compressed token ``j`` adds ``wt[j, k] * p_j`` to block
    ``blk[j, k]`` (``k`` over the at most ``(l-1)//l_sel + 2`` blocks its span touches). Unused entries
    point at the scratch block ``n_blocks`` with weight 0. Returns ``(blk, wt)``."""
    K = (l - 1) // l_sel + 2
    j = torch.arange(n_cmp, device=device)[:, None]
    b = torch.div(j * d, l_sel, rounding_mode="floor") + torch.arange(K, device=device)[None, :]
    lo = torch.maximum(j * d, b * l_sel)
    hi = torch.minimum(j * d + l, (b + 1) * l_sel)
    ov = (hi - lo).clamp(min=0)
    ok = (ov > 0) & (b < n_blocks)
    blk = torch.where(ok, b, torch.full_like(b, n_blocks))
    return blk, torch.where(ok, ov, torch.zeros_like(ov)).to(torch.float32) / l


FORCED_PRIORITY = (3.0e6, 2.0e6, 1.0e6)  # sort keys of the current, initial and previous block (above any P)


def top_n_blocks(P: torch.Tensor, bt: torch.Tensor, n_sel: int) -> torch.Tensor:
    """Spec top-n, vectorised: forced blocks (current ``bt``, 0, previous) first, then the highest ``P``
    among the candidates ``b <= bt``, ties to the lower index; ascending, ``-1`` padded.

    ``P [..., nb]`` block importance, ``bt`` each query's current block, shaped to broadcast against
    ``P[..., :1]``. Returns int32 ``[..., n_sel]``."""
    nb = P.shape[-1]
    blk = torch.arange(nb, device=P.device)
    cand = blk <= bt
    key = P.to(torch.float64) if P.dtype == torch.float64 else P.float()
    key = key.masked_fill(~cand, float("-inf"))
    for prio, hit in zip(FORCED_PRIORITY[::-1], (blk == bt - 1, blk == 0, blk == bt), strict=True):
        key = torch.where(hit & cand, torch.full_like(key, prio), key)
    vals, order = torch.sort(key, dim=-1, descending=True, stable=True)
    k = min(n_sel, nb)
    picked = torch.where(torch.isfinite(vals[..., :k]), order[..., :k], torch.full_like(order[..., :k], nb))
    picked, _ = torch.sort(picked, dim=-1)  # ascending, padding (nb) last
    picked = torch.where(picked == nb, torch.full_like(picked, -1), picked)
    if k < n_sel:
        picked = torch.cat([picked, picked.new_full((*picked.shape[:-1], n_sel - k), -1)], dim=-1)
    return picked.to(torch.int32)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the ``mask``-ed entries of the last dim; a row with none gives zeros (never NaN)."""
    if scores.shape[-1] == 0:
        return scores
    scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m).masked_fill(~mask, 0.0)
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def forced_blocks(t: int, l_sel: int) -> list[int]:
    """Forced blocks of query ``t`` in priority order: current, initial, previous (deduplicated)."""
    bt = t // l_sel
    out: list[int] = []
    for b in (bt, 0, bt - 1):
        if 0 <= b <= bt and b not in out:
            out.append(b)
    return out


def check_q_start(q_start: int, S_q: int, S_k: int | None = None) -> None:
    """Queries at an offset: rows ``q_start .. q_start + S_q - 1`` must lie inside the ``S_k`` key
    positions."""
    if isinstance(q_start, bool) or not isinstance(q_start, (int, torch.SymInt)) or q_start < 0:
        raise ValueError(f"q_start must be an integer >= 0, got {q_start!r}")
    if S_k is not None and q_start + S_q > S_k:
        raise ValueError(f"q_start={q_start} with {S_q} query rows reaches position {q_start + S_q - 1}, "
                         f"past the {S_k} key positions: pass keys up to the last query (S_k >= q_start + "
                         "S_q)")


def with_window_query(q: torch.Tensor, q_win: torch.Tensor | None,
                      tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``tensors`` and ``q_win`` when given (what the dispatcher checks), after checking that ``q_win`` (the
    window branch's own queries) has ``q``'s shape and dtype."""
    if q_win is None:
        return tensors
    if q_win.shape != q.shape or q_win.dtype != q.dtype:
        raise ValueError(f"q_win {tuple(q_win.shape)} {q_win.dtype} must have q's shape and dtype "
                         f"{tuple(q.shape)} {q.dtype}")
    return (*tensors, q_win)


def check_cmp_tokens(n_tokens: int, q_start: int, S_q: int, l: int, d: int) -> None:  # noqa: E741
    """``k_cmp`` must hold every compressed token the last query row (position ``q_start + S_q - 1``) sees."""
    need = num_visible_cmp(q_start + S_q - 1, l, d) if S_q else 0
    if n_tokens < need:
        raise ValueError(f"k_cmp holds {n_tokens} compressed tokens but the query at position "
                         f"{q_start + S_q - 1} sees {need}: compress the keys up to the last query")


def check_shapes(q: torch.Tensor, k: torch.Tensor, *, name: str = "k",
                 q_start: int = 0) -> tuple[int, int, int, int, int, int]:
    """Validate ``q [B,S_q,HQ,Dk]`` (rows at positions ``q_start ..``) against raw ``k [B,S_k,H,Dk]``
    (positions ``0 .. S_k - 1``, ``S_k >= q_start + S_q``); returns ``B, S_q, S_k, HQ, H, h``."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and {name} must be 4-D [B, S, heads, dim], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    B, S_q, HQ, _ = q.shape
    H, S_k = k.shape[2], k.shape[1]
    if k.shape[0] != B:
        raise ValueError(f"{name} {tuple(k.shape)} does not match q {tuple(q.shape)} in batch")
    check_q_start(q_start, S_q, S_k)
    if HQ % H:
        raise ValueError(f"query heads HQ={HQ} must be a multiple of key/value heads H={H}")
    return B, S_q, S_k, HQ, H, HQ // H
