"""Gate and selection statistics: accumulated on the device during training, read with one transfer.

Each NSA layer keeps a small float64 vector of running sums (see ``FIELDS``); nothing in the forward
pass reads a value back to the host. ``summarise`` turns summed vectors into the heartbeat fields
``gate_entropy_mean``, ``gate_branch_shares``, ``gate_collapse_fraction``, ``gate_mean``,
``sel_keys_mean``, ``scorer_kl`` and ``align_nll``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Order of the running sums in an accumulator vector.
FIELDS = (
    "entropy",  # sum over (token, head) of the entropy of the normalised gate shares
    "share_cmp",
    "share_sel",
    "share_win",  # sums of the normalised shares per branch
    "gate_cmp",
    "gate_sel",
    "gate_win",  # sums of the activated gate values per branch
    "collapsed",  # (token, head) whose largest share exceeds the collapse threshold
    "gate_count",  # number of (token, head)
    "sel_keys",  # sum over (token, group) of raw positions the selected branch attends
    "sel_count",  # number of (token, group)
    "scorer_kl",  # sum over training forwards of the scorer loss (nsa.model.selection.scorer_kl)
    "scorer_count",  # number of those forwards
    # sum over training forwards of the alignment loss (-log recall, nsa.model.selection.align_loss)
    "align_nll", "align_count",  # number of those forwards
)
N_FIELDS = len(FIELDS)
SCORER = FIELDS.index("scorer_kl")  # the scorer loss's two fields start here
ALIGN = FIELDS.index("align_nll")  # and the alignment loss's
LN3 = math.log(3.0)


@torch.no_grad()
def gate_sums(gates: torch.Tensor, collapse_threshold: float) -> torch.Tensor:
    """Running-sum contributions of activated gates ``[B, S, HQ, 3]`` (fields 0..8), float64."""
    g = gates.detach().to(torch.float64)
    shares = g / g.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    ent = -(shares * shares.clamp_min(1e-30).log()).sum(dim=-1)
    collapsed = (shares.amax(dim=-1) > collapse_threshold).to(torch.float64)
    n = torch.full((1,), float(ent.numel()), dtype=torch.float64, device=g.device)  # a fill, not a copy
    return torch.cat(
        [ent.sum()[None], shares.sum(dim=(0, 1, 2)), g.sum(dim=(0, 1, 2)), collapsed.sum()[None], n]
    )


@torch.no_grad()
def selected_keys(block_idx: torch.Tensor, l_sel: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Raw positions ``<= t`` covered by the chosen blocks ``[B, S, H, n_sel]`` (``-1`` = none): ``[B, S,
    H]``."""
    if positions is None:
        positions = torch.arange(block_idx.shape[1], device=block_idx.device)
    t = positions[:, :, None, None] if positions.dim() == 2 else positions[None, :, None, None]
    idx = block_idx.to(torch.int64)
    start = idx * l_sel
    cnt = (torch.minimum(start + l_sel, t + 1) - start).clamp(min=0)
    return torch.where(idx >= 0, cnt, torch.zeros_like(cnt)).sum(dim=-1)


@torch.no_grad()
def selection_sums(block_idx: torch.Tensor, l_sel: int) -> torch.Tensor:
    """Running-sum contributions (fields 9, 10) of the blocks a training forward used."""
    keys = selected_keys(block_idx, l_sel).to(torch.float64)
    n = torch.full((1,), float(keys.numel()), dtype=torch.float64, device=keys.device)
    return torch.cat([keys.sum()[None], n])


def summarise(sums: Sequence[float]) -> dict[str, float | list[float]]:
    """Heartbeat fields from one summed accumulator vector (host floats)."""
    out: dict[str, float | list[float]] = {}
    n = sums[8]
    if n > 0:
        out["gate_entropy_mean"] = sums[0] / n
        out["gate_branch_shares"] = [sums[1] / n, sums[2] / n, sums[3] / n]
        out["gate_mean"] = [sums[4] / n, sums[5] / n, sums[6] / n]
        out["gate_collapse_fraction"] = sums[7] / n
    if sums[10] > 0:
        out["sel_keys_mean"] = sums[9] / sums[10]
    if sums[SCORER + 1] > 0:
        out["scorer_kl"] = sums[SCORER] / sums[SCORER + 1]
    if sums[ALIGN + 1] > 0:
        out["align_nll"] = sums[ALIGN] / sums[ALIGN + 1]
    return out


@torch.no_grad()
def loss_sums(mean: torch.Tensor, share: float = 1.0) -> torch.Tensor:
    """Running-sum contributions (the two fields at :data:`SCORER`, or at :data:`ALIGN`) of one forward's
    scorer (or alignment) loss, a mean (``share``: the part of the forward it covers, one packed document's
    tokens)."""
    w = torch.full((), share, dtype=torch.float64, device=mean.device)
    return torch.stack([mean.detach().to(torch.float64) * w, w])
