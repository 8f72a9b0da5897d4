"""Does selection find what dense attention would attend to? Diagnostics and the scorer loss.

For a sample of query positions ``ts`` of one NSA layer (the selected branch's ``q``/``k``):

- :func:`block_mass` (:func:`dense_block_mass` without gradient): dense causal attention
  ``softmax(q k^T * scale)`` over every key ``<= t``, summed per selection block and averaged over the
  group's heads: ``[B, H, C, nb]``.
- :func:`recall`: the share of that mass inside the blocks the layer selected (1.0: selection lost
  nothing dense attention would have read).
- :func:`compressed_probs`, :func:`block_scores`: the block importance the op ranks by (spec Eq. 8-9:
  the compressed branch's probabilities, summed over the group's heads and spread over the blocks they
  overlap), normalised over the candidate blocks ``b <= t // l_sel``; :func:`cmp_entropy` of those
  probabilities (diagnostics only: the scorer loss does not compute it).
- :func:`scorer_kl`: ``KL(dense block mass || block scores)`` (the target detached): a gradient to the
  scorer (``q`` and the compressed keys), which top-n selection otherwise never gives it.
- :func:`align_loss`: ``-log recall`` with gradient into ``q`` and the selected branch's keys: the other
  direction, dense attention drawn into the selected blocks (the keys left out learn to be suppressed).

:func:`probe_positions` picks the positions: evenly spaced from the first one with more candidate
blocks than ``n_sel`` (before it every block is selected and recall is 1 by construction).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nsa.ops.indexing import masked_softmax, overlap_weights, top_n_blocks, visible_cmp_counts
from nsa.params import NSAParams
from nsa.rundir.records import SELECTION_FIELDS


def first_choice(hp: NSAParams) -> int:
    """The first position whose query chooses among blocks (``n_sel * l_sel``): before it every block is
    selected, so a sequence of at most this many tokens has nothing to probe or score."""
    return hp.n_sel * hp.l_sel


def probe_range(S: int, hp: NSAParams, n: int) -> range | None:
    """``n`` (at most) distinct positions, evenly spaced over ``[n_sel * l_sel, S)``; ``None`` when that
    range is empty (every query selects all its blocks) or ``n <= 0``."""
    t0 = first_choice(hp)
    if n <= 0 or t0 >= S:
        return None
    C = min(n, S - t0)
    step = max((S - 1 - t0) // max(C - 1, 1), 1)
    return range(t0, t0 + C * step, step)


def probe_positions(S: int, hp: NSAParams, n: int,
                    device: torch.device | str | None = None) -> torch.Tensor | None:
    """:func:`probe_range` as an int64 tensor on ``device``."""
    r = probe_range(S, hp, n)
    return None if r is None else torch.arange(r.start, r.stop, r.step, device=device)


def _wide(x: torch.Tensor) -> torch.dtype:
    """float32 at least (bf16 activations are measured in float32, float64 ones stay float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _group_rows(q: torch.Tensor, ts: torch.Tensor, H: int) -> torch.Tensor:
    """Queries at ``ts`` as ``[B, H, h, C, Dk]``, float32 at least (the group's heads together)."""
    B, _, HQ, Dk = q.shape
    qs = q[:, ts].to(_wide(q))
    return qs.view(B, qs.shape[1], H, HQ // H, Dk).permute(0, 2, 3, 1, 4)


def block_mass(q: torch.Tensor, k: torch.Tensor, ts: torch.Tensor, hp: NSAParams, scale: float,
               q_start: int = 0) -> torch.Tensor:
    """Dense attention mass per selection block at ``ts``, mean over each group's heads: ``[B, H, C, nb]``.

    ``q [B, Sq, HQ, Dk]`` (the rows of positions ``q_start ..``), ``k [B, S, H, Dk]`` (the selected branch's
    keys of positions ``0 .. S-1``); float32 at least, differentiable in both (the alignment loss's;
    :func:`dense_block_mass` without gradient)."""
    _, S, H, _ = k.shape
    qg = _group_rows(q, ts - q_start, H)
    logits = torch.einsum("bhgcd,bshd->bhgcs", qg, k.to(_wide(k))) * scale
    mask = torch.arange(S, device=q.device)[None, :] <= ts[:, None]
    p = masked_softmax(logits, mask[None, None, None])
    nb = -(-S // hp.l_sel)
    p = F.pad(p, (0, nb * hp.l_sel - S))
    return p.view(*p.shape[:-1], nb, hp.l_sel).sum(-1).mean(dim=2)


@torch.no_grad()
def dense_block_mass(q: torch.Tensor, k: torch.Tensor, ts: torch.Tensor, hp: NSAParams,
                     scale: float) -> torch.Tensor:
    """:func:`block_mass` without gradient (the probe's, and the scorer loss's target)."""
    return block_mass(q, k, ts, hp, scale)


def compressed_probs(q: torch.Tensor, k_cmp: torch.Tensor, ts: torch.Tensor, S: int, hp: NSAParams,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, n_vis)``: the compressed branch's attention at ``ts`` over its visible tokens, ``[B, H, h, C,
    n]`` float32 at least (differentiable in ``q`` and ``k_cmp``), and the visible count per position
    ``[C]``."""
    n, H = k_cmp.shape[1], k_cmp.shape[2]
    n_vis = visible_cmp_counts(S, hp.l, hp.d, device=q.device)[ts]
    vis = torch.arange(n, device=q.device)[None, :] < n_vis[:, None]
    logits = torch.einsum("bhgcd,bnhd->bhgcn", _group_rows(q, ts, H), k_cmp.to(_wide(k_cmp))) * scale
    return masked_softmax(logits, vis[None, None, None]), n_vis


def block_scores(p: torch.Tensor, ts: torch.Tensor, S: int, hp: NSAParams) -> torch.Tensor:
    """Block importance of :func:`compressed_probs` ``p`` (spec Eq. 9: summed over the group's heads, spread
    over the blocks each compressed token overlaps), normalised over the candidate blocks: ``[B, H, C,
    nb]``."""
    nb = -(-S // hp.l_sel)
    W = overlap_weights(p.shape[-1], nb, hp.l, hp.d, hp.l_sel, device=p.device)
    cand = torch.arange(nb, device=p.device)[None, :] <= (ts // hp.l_sel)[:, None]
    P = torch.matmul(p.sum(dim=2), W) * cand
    return P / P.sum(dim=-1, keepdim=True).clamp_min(1e-12)


@torch.no_grad()
def cmp_entropy(p: torch.Tensor, n_vis: torch.Tensor) -> torch.Tensor:
    """Entropy of :func:`compressed_probs` ``p`` over ``log(visible tokens)`` per (batch, head, position),
    ``[B, HQ, C]`` (1: uniform)."""
    ent = -torch.xlogy(p, p).sum(dim=-1) / torch.log(n_vis.clamp_min(2).to(p.dtype))
    return ent.reshape(ent.shape[0], -1, ent.shape[-1])


def recall(mass: torch.Tensor, block_idx: torch.Tensor) -> torch.Tensor:
    """Share of ``mass [B, H, C, nb]`` inside the selected blocks ``block_idx [B, C, H, n_sel]`` (``-1``:
    none): ``[B, H, C]``."""
    idx = block_idx.permute(0, 2, 1, 3).long()
    picked = mass.gather(-1, idx.clamp(min=0)) * (idx >= 0)
    return picked.sum(dim=-1)


def best_recall(mass: torch.Tensor, ts: torch.Tensor, hp: NSAParams) -> torch.Tensor:
    """Recall's ceiling: the share of ``mass [B, H, C, nb]`` at positions ``ts`` in the blocks the spec's
    top-n would choose if the block scores were the mass itself (forced blocks first; ``top_n_blocks``), what
    a perfect block scorer reaches: ``[B, H, C]``. Below 1 when dense attention spreads over more than
    ``n_sel`` blocks."""
    best = top_n_blocks(mass, (ts // hp.l_sel)[:, None], hp.n_sel)  # [B, H, C, n_sel]
    return recall(mass, best.permute(0, 2, 1, 3))


def forced_recall(mass: torch.Tensor, ts: torch.Tensor, hp: NSAParams) -> torch.Tensor:
    """The share of ``mass [B, H, C, nb]`` at ``ts`` in the blocks every query keeps whatever the scores (the
    first, the current and the previous: ``top_n_blocks`` with ``n_sel = 3`` on zero scores): ``[B, H, C]``.
    Recall above it is what the chosen blocks found; recall near it says dense attention sits where no
    choice is made (the sink and the neighbourhood)."""
    forced = top_n_blocks(torch.zeros_like(mass), (ts // hp.l_sel)[:, None], min(3, hp.n_sel))  # [B, H, C, 3]
    return recall(mass, forced.permute(0, 2, 1, 3))


def scorer_kl(target: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """Mean over (batch, group, position) of ``KL(target || P)`` over blocks; ``target`` is not
    differentiated."""
    t = target.detach()
    kl = torch.xlogy(t, t) - t * torch.log(P.clamp_min(1e-9))
    return kl.sum(dim=-1).mean()


def align_loss(mass: torch.Tensor, block_idx: torch.Tensor) -> torch.Tensor:
    """Mean over (batch, group, position) of ``-log recall``: the dense attention
    mass (:func:`block_mass`, with gradient) that the selected blocks ``block_idx [B, C, H, n_sel]`` leave
    out, as a loss. Its gradient lowers the keys selection left out and raises the chosen ones: the keys
    sparse training never reaches learn to be suppressed (SSA, arXiv 2511.20102, in probability space), which
    lifts recall's ceiling."""
    return -torch.log(recall(mass, block_idx).clamp_min(1e-6)).mean()


def layer_report(q: torch.Tensor, k_sel: torch.Tensor, k_cmp: torch.Tensor, block_idx: torch.Tensor,
                 gates: torch.Tensor, hp: NSAParams, scale: float,
                 queries: int) -> dict[str, float | list[float] | None]:
    """One layer's diagnostics on one batch: ``recall``, its ceiling ``recall_best`` (:func:`best_recall`),
    the forced blocks' share ``recall_forced`` (:func:`forced_recall`) and ``cmp_entropy`` over the probe
    positions (``None`` when the sequence is too short for selection to choose), the scorer's ``kl`` to the
    dense mass, and the mean gate per branch ``gates`` ([cmp, sel, win])."""
    g = [float(x) for x in gates.float().mean(dim=(0, 1, 2)).tolist()]
    S = q.shape[1]
    ts = probe_positions(S, hp, queries, q.device)
    if ts is None:
        return {**dict.fromkeys(SELECTION_FIELDS), "gates": g}
    with torch.no_grad():
        mass = dense_block_mass(q, k_sel, ts, hp, scale)
        p, n_vis = compressed_probs(q, k_cmp, ts, S, hp, scale)
        rec = recall(mass, block_idx[:, ts])
        best = best_recall(mass, ts, hp)
        forced = forced_recall(mass, ts, hp)
        kl = scorer_kl(mass, block_scores(p, ts, S, hp))
        ent = cmp_entropy(p, n_vis)
    return {"recall": float(rec.mean()), "recall_best": float(best.mean()),
            "recall_forced": float(forced.mean()), "cmp_entropy": float(ent.mean()), "kl": float(kl),
            "gates": g}


def merge_reports(parts: list[tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """One report from :func:`layer_report` s of several documents, each with its length in tokens: every
    field the token-weighted mean over the documents that have it (``None`` when none does: all too short to
    choose); empty for no documents."""
    if not parts:
        return {}
    out: dict[str, Any] = {}
    for key in SELECTION_FIELDS:
        have = [(float(r[key]), n) for r, n in parts if r.get(key) is not None]
        out[key] = sum(v * n for v, n in have) / sum(n for _, n in have) if have else None
    total = sum(n for _, n in parts)
    out["gates"] = [sum(r["gates"][i] * n for r, n in parts) / total for i in range(3)]
    return out


class AttachLoss(torch.autograd.Function):
    """``x`` unchanged forward; backward also sends a gradient of 1 to ``loss`` (an auxiliary loss joins
    the backward pass without entering the reported loss)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,
                loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor,
                                                                                        torch.Tensor]:
        return grad, grad.new_ones(ctx.loss_shape, dtype=ctx.loss_dtype)  # type: ignore[attr-defined]

