"""Single-query NSA attention for decoding: one new query per sequence against cached keys/values.

The index sets are exactly the spec's (``docs/nsa-semantics.md``) for a query at position ``t``:
the ``N_c(t)`` visible compressed tokens, the raw positions ``<= t`` of the chosen selection blocks
(scored from this query's compressed-branch probabilities, forced blocks current/initial/previous,
ties to the lower index) and the window ``max(0, t-w+1) .. t``. ``reads`` counts those positions,
measured from the masks actually applied. Every sequence of the batch has its own position ``t[b]``.

Cache layouts (head-major, one row per KV group):
- ``k_cmp, v_cmp [B, H, C, D]``: compressed token ``j`` in slot ``j``; slots ``>= N_c(t)`` are ignored.
- ``k_sel, v_sel [B, H, T, D]``: raw position ``p`` in slot ``p``; slots ``> t`` are ignored.
- ``k_win, v_win [B, H, R, D]``: ring, raw position ``p`` in slot ``p % R``; ``R >= min(w, t + 1)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nsa.ops.dispatch import pick, register
from nsa.ops.indexing import cmp_block_table, masked_softmax, top_n_blocks, visible_cmp, with_window_query
from nsa.params import NSAParams

try:  # the fused Triton step is optional: without triton every call runs the torch step
    from nsa.ops._triton import decode as _triton_decode
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    _triton_decode = None  # type: ignore[assignment]


class DecodeOutput(NamedTuple):
    """``o [B, HQ, Dv]``, ``block_idx`` int32 ``[B, H, n_sel]`` (ascending, -1 padded), ``reads [B, H]``."""

    o: torch.Tensor
    block_idx: torch.Tensor
    reads: torch.Tensor


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, H, h, Dk]`` over ``k/v [B, H, n, D]`` with ``mask [B, H|1, n]``: (out, probabilities)."""
    # scores in fp32 (the Triton kernels' accumulator): they rank the selection blocks
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # [B, H, h, n]
    p = masked_softmax(s, mask[:, :, None, :])
    return torch.matmul(p.to(v.dtype), v), p


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
          scale: float) -> torch.Tensor:
    """Fused attention of ``q [B, H, h, Dk]`` over ``k/v [B, H, n, D]`` with a never-empty ``mask [B, H|1,
    n]`` (the ``h`` heads of a group are the query rows; no causal flag, the mask says everything)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, :, None, :], scale=scale)


def top_blocks(P: torch.Tensor, t: torch.Tensor, l_sel: int, n_sel: int) -> torch.Tensor:
    """Spec top-n for one query per sequence: ``P [B, H, nb]``, ``t [B]`` -> int32 ``[B, H, n_sel]``."""
    return top_n_blocks(P, torch.div(t, l_sel, rounding_mode="floor")[:, None, None], n_sel)


def nsa_decode(
    q: torch.Tensor,
    t: torch.Tensor,
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
    table: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str | None = None,
    q_win: torch.Tensor | None = None,
) -> DecodeOutput:
    """NSA output of one query per sequence: ``q [B, HQ, Dk]`` at positions ``t [B]``; ``gates [B, HQ, 3]``.

    ``q_win``: the sliding-window branch's own queries (``q``'s shape and dtype); ``None`` uses ``q``.
    The compressed and selected branches, and the block scores behind ``block_idx``, always use ``q``.

    ``table`` is ``cmp_block_table(C, ceil(T / l_sel), ...)`` (torch path; computed when not given).
    ``backend`` (as for ``nsa_attention``; default ``NSA_ATTN_BACKEND``, else ``auto``): ``triton`` runs
    the fused four-kernel step of ``nsa.ops._triton.decode``, ``auto`` does so for CUDA tensors, and
    ``torch``/``reference`` run this vectorised torch path, which is the fused step's reference. A
    requested ``triton`` that cannot serve the call falls back here, counted in
    ``nsa.ops.fallback_counts()``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    tensors = with_window_query(q, q_win, (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates))
    _, impl = pick("nsa_decode", backend, tensors, hp=hp)
    out: DecodeOutput = impl(q, t, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, hp, scale=scale,
                             table=table, q_win=q_win)
    return out


def _decode_triton(q: torch.Tensor, t: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                   k_sel: torch.Tensor, v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
                   gates: torch.Tensor, hp: NSAParams, *, scale: float,
                   table: tuple[torch.Tensor, torch.Tensor] | None = None,
                   q_win: torch.Tensor | None = None) -> DecodeOutput:
    """The fused four-kernel step (``nsa.ops._triton.decode``); ``table`` is the torch path's."""
    assert _triton_decode is not None  # dispatch sends here only when triton_decode_supported
    return DecodeOutput(*_triton_decode.nsa_decode_triton(q, t, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win,
                                                          gates,
                                           l=hp.l, d=hp.d, l_sel=hp.l_sel, n_sel=hp.n_sel, w=hp.w,
                                                          scale=scale,
                                           q_win=q_win))


def _decode_torch(q: torch.Tensor, t: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                  k_sel: torch.Tensor, v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
                  gates: torch.Tensor, hp: NSAParams, *, scale: float,
                  table: tuple[torch.Tensor, torch.Tensor] | None = None,
                  q_win: torch.Tensor | None = None) -> DecodeOutput:
    """The vectorised torch step: the fused Triton step's reference (the index sets of the module doc);
    the window branch attends with ``q_win`` when given."""
    l, d, l_sel, n_sel, w = hp.l, hp.d, hp.l_sel, hp.n_sel, hp.w  # noqa: E741
    B, HQ, Dk = q.shape
    H, C, T, R = k_cmp.shape[1], k_cmp.shape[2], k_sel.shape[2], k_win.shape[2]
    h = HQ // H
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    t = t.to(device=dev, dtype=torch.int64)
    qg = q.reshape(B, H, h, Dk)

    # compressed branch over the N_c(t) visible tokens; its probabilities score the selection blocks
    n_c = visible_cmp(t, l, d)
    cmp_mask = (torch.arange(C, device=dev)[None, :] < n_c[:, None])[:, None, :]  # [B, 1, C]
    o_cmp, p_cmp = _attend(qg, k_cmp, v_cmp, cmp_mask, scale, acc)

    nb = -(-T // l_sel)
    blk_tab, wt_tab = table if table is not None else cmp_block_table(C, nb, l, d, l_sel, device=dev)
    p_group = p_cmp.sum(dim=2)  # [B, H, C]  (Eq. 10: sum over the heads of a group)
    K = blk_tab.shape[1]
    contrib = (p_group[..., None] * wt_tab.to(acc)).reshape(B, H, C * K)
    P = torch.zeros(B, H, nb + 1, dtype=acc, device=dev)
    P.scatter_add_(-1, blk_tab.reshape(1, 1, C * K).expand(B, H, C * K), contrib)
    block_idx = top_blocks(P[..., :nb], t, l_sel, n_sel)  # [B, H, n_sel]

    # selected branch: raw positions <= t of the chosen blocks (each block once, so each position once)
    bi = block_idx.to(torch.int64)
    pos = (bi[..., None] * l_sel + torch.arange(l_sel, device=dev)).reshape(B, H, n_sel * l_sel)
    sel_mask = (bi[..., None] >= 0).expand(B, H, n_sel, l_sel).reshape(B, H, -1) & (pos <= t[:, None, None])
    gidx = pos.clamp(0, T - 1)[..., None]
    ks = torch.gather(k_sel, 2, gidx.expand(B, H, n_sel * l_sel, k_sel.shape[-1]))
    vs = torch.gather(v_sel, 2, gidx.expand(B, H, n_sel * l_sel, v_sel.shape[-1]))
    o_sel = _sdpa(qg, ks, vs, sel_mask, scale)

    # sliding window from the ring: slot s holds position t - ((t - s) mod R)
    slot = torch.arange(R, device=dev)[None, :]
    p_win = t[:, None] - torch.remainder(t[:, None] - slot, R)
    win_mask = ((p_win >= 0) & (p_win > t[:, None] - w))[:, None, :]  # [B, 1, R]
    qw = qg if q_win is None else q_win.reshape(B, H, h, Dk)
    o_win = _sdpa(qw, k_win, v_win, win_mask, scale)

    g = gates.reshape(B, H, h, 3).to(o_cmp.dtype)
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
    reads = n_c[:, None] + sel_mask.sum(dim=-1) + win_mask.sum(dim=-1)
    return DecodeOutput(o.reshape(B, HQ, -1), block_idx, reads)


_COMPILED: dict[str, Callable[..., DecodeOutput]] = {}


def compiled_nsa_decode() -> Callable[..., DecodeOutput]:
    """``nsa_decode`` through ``torch.compile`` (static shapes, created once): the step's ~100 small
    kernels fuse into a few, which is what a batch-1 decode step's time is made of."""
    fn = _COMPILED.get("nsa_decode")
    if fn is None:
        fn = _COMPILED["nsa_decode"] = torch.compile(nsa_decode, dynamic=False)
    return fn


def triton_decode_supported(*tensors: torch.Tensor, hp: NSAParams) -> str | None:
    """None when the fused Triton decode step (``nsa.ops._triton.decode``) can serve these tensors and
    block sizes, else a short reason."""
    if _triton_decode is None:  # pragma: no cover - triton ships with CUDA builds of torch
        return "triton not installed"
    return _triton_decode.decode_unsupported(hp.l, hp.d, hp.l_sel, *tensors)


def _register() -> None:
    for name in ("reference", "torch"):  # the torch step is the decode reference
        register("nsa_decode", name, _decode_torch)
    register("nsa_decode", "triton", _decode_triton, unsupported=triton_decode_supported)


_register()
