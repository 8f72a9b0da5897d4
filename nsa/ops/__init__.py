"""NSA functional ops: the public kernel-level API, the same call for every backend.

``compress_avg(x, l, d)``, ``select_blocks(q, k_cmp, *, l, d, l_sel, n_sel, scale=None)`` and
``nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, l, d, l_sel, n_sel, w,
scale=None, block_idx=None)``; see ``docs/nsa-semantics.md`` for what they compute. Each also takes
``backend=`` (``auto``, ``reference``, ``torch``, ``triton``) to override the process default
(``set_default_backend``, ``use_backend``; ``auto`` unless set).
"""

from __future__ import annotations

import torch

from nsa.ops.dispatch import (
    BACKENDS,
    available_backends,
    fallback_counts,
    record_fallback,
    requested_backend,
    reset_fallback_counts,
    resolve,
    set_default_backend,
    use_backend,
)


def compress_avg(x: torch.Tensor, l: int, d: int, *, backend: str | None = None) -> torch.Tensor:  # noqa: E741
    """Mean-pool raw ``x [B, S, H, D]`` into compressed tokens ``[B, S_cmp, H, D]`` (block ``l``, stride ``d``)."""
    out: torch.Tensor = resolve(backend, (x,), "compress_avg").compress_avg(x, l, d)
    return out


def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    *,
    l: int,  # noqa: E741
    d: int,
    l_sel: int,
    n_sel: int,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Selection blocks per query and group: int32 ``[B, S, H, n_sel]``, ascending, ``-1`` padded."""
    out: torch.Tensor = resolve(backend, (q, k_cmp), "select_blocks").select_blocks(
        q, k_cmp, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=scale
    )
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
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gated NSA attention ``[B, S, HQ, Dv]``; with ``return_block_idx`` also the blocks used."""
    tensors = (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)
    mod = resolve(backend, tensors, "nsa_attention")
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = mod.nsa_attention(
        *tensors, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, scale=scale, block_idx=block_idx,
        return_block_idx=return_block_idx,
    )
    return out


__all__ = [
    "BACKENDS",
    "available_backends",
    "compress_avg",
    "fallback_counts",
    "nsa_attention",
    "record_fallback",
    "requested_backend",
    "reset_fallback_counts",
    "select_blocks",
    "set_default_backend",
    "use_backend",
]
