"""Index arithmetic shared by every NSA path (the formulas of the spec, in one place)."""

from __future__ import annotations

import math

import torch


def num_cmp(S: int, l: int, d: int) -> int:  # noqa: E741
    """Compressed tokens of a length-``S`` sequence: ``max(0, floor((S - l) / d) + 1)``."""
    return max(0, (S - l) // d + 1)


def num_visible_cmp(t: int, l: int, d: int) -> int:  # noqa: E741
    """Compressed tokens visible to the query at position ``t`` (last raw position ``<= t``)."""
    return max(0, (t + 1 - l) // d + 1)


def num_sel_blocks(S: int, l_sel: int) -> int:
    """Selection blocks that cover ``S`` positions."""
    return math.ceil(S / l_sel)


def visible_cmp_counts(S: int, l: int, d: int, device: torch.device | str | None = None) -> torch.Tensor:  # noqa: E741
    """``N_c(t)`` for ``t = 0 .. S-1`` as an int64 tensor."""
    t = torch.arange(S, device=device)
    return torch.clamp(torch.div(t + 1 - l, d, rounding_mode="floor") + 1, min=0)


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


def forced_blocks(t: int, l_sel: int) -> list[int]:
    """Forced blocks of query ``t`` in priority order: current, initial, previous (deduplicated)."""
    bt = t // l_sel
    out: list[int] = []
    for b in (bt, 0, bt - 1):
        if 0 <= b <= bt and b not in out:
            out.append(b)
    return out


def check_hparams(l: int, d: int, l_sel: int, n_sel: int, w: int | None = None) -> None:  # noqa: E741
    """Reject invalid hyper-parameters with a message that names the field."""
    for name, value in (("l", l), ("d", d), ("l_sel", l_sel), ("n_sel", n_sel)) + ((("w", w),) if w is not None else ()):
        if int(value) < 1:
            raise ValueError(f"nsa.{name}={value} must be positive")
    if l % d:
        raise ValueError(f"nsa.d={d} must divide nsa.l={l}")
    if l_sel % d:
        raise ValueError(f"nsa.d={d} must divide nsa.l_sel={l_sel}")
    if l_sel < d:
        raise ValueError(f"nsa.l_sel={l_sel} must be >= nsa.d={d}")


def check_shapes(q: torch.Tensor, k: torch.Tensor, *, name: str = "k") -> tuple[int, int, int, int, int]:
    """Validate ``q [B,S,HQ,Dk]`` against raw ``k [B,S,H,Dk]``; returns ``B, S, HQ, H, h``."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and {name} must be 4-D [B, S, heads, dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, S, HQ, _ = q.shape
    H = k.shape[2]
    if k.shape[0] != B or k.shape[1] != S:
        raise ValueError(f"{name} {tuple(k.shape)} does not match q {tuple(q.shape)} in batch/sequence")
    if HQ % H:
        raise ValueError(f"query heads HQ={HQ} must be a multiple of key/value heads H={H}")
    return B, S, HQ, H, HQ // H
