"""NSA functional ops: the public kernel-level API, the same call for every backend.

``compress_avg(x, hp)``, ``select_blocks(q, k_cmp, hp, *, scale=None)`` and
``nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, hp, *, scale=None, block_idx=None)``
with ``hp`` an :class:`NSAParams` (the five hyper-parameters as one frozen object); see
``docs/nsa-semantics.md`` for what they compute. ``q_win`` (``nsa_attention``): the window branch's own
queries (``q``'s shape); the compressed and selected branches and the block scores keep ``q``. ``q_start``
(``select_blocks``, ``nsa_attention``): the query rows sit at positions ``q_start ..`` of the keys (context
parallelism: a rank's own rows against the gathered prefix). Each also takes ``backend=`` (``auto``,
``reference``,
``torch``, ``triton``) to override the process default (``set_default_backend``, ``use_backend``;
``auto`` unless set).
"""

from __future__ import annotations

import torch

from nsa.ops import varlen
from nsa.ops._triton import TUNE_KEYS, tile_overrides
from nsa.ops.dispatch import (
    BACKENDS,
    available_backends,
    pick,
    requested_backend,
    set_default_backend,
    use_backend,
)
from nsa.ops.fallbacks import fallback_counts, record_fallback, reset_fallback_counts
from nsa.ops.indexing import with_window_query
from nsa.params import NSAParams


def _packed(name: str, x: torch.Tensor, cu_seqlens: torch.Tensor, q_start: int = 0) -> tuple[list[int],
    int | None]:
    """The host offsets, and from what length a document runs alone (the reference: every one, the definition
    itself; :func:`nsa.ops.varlen.plan`)."""
    if q_start != 0:
        raise ValueError(f"q_start={q_start} cannot be combined with cu_seqlens: packed documents start at "
                         "position 0 (pass q_start=0, or run the documents without cu_seqlens)")
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a batch-1 packed row, got batch {x.shape[0]}")
    return varlen.host_offsets(cu_seqlens, x.shape[1]), 0 if name == "reference" else None


def compress_avg(
    x: torch.Tensor, hp: NSAParams, *, backend: str | None = None, cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean-pool raw ``x [B, S, H, D]`` into compressed tokens ``[B, S_cmp, H, D]`` (block ``l``, stride
    ``d``)."""
    name, impl = pick("compress_avg", backend, (x,))
    if cu_seqlens is not None:
        cu, alone = _packed(name, x, cu_seqlens)
        return varlen.compress_packed(lambda t: impl(t, hp), x, cu, hp, alone_from=alone)
    out: torch.Tensor = impl(x, hp)
    return out


def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    hp: NSAParams,
    *,
    scale: float | None = None,
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    q_start: int = 0,
) -> torch.Tensor:
    """Selection blocks per query and group: int32 ``[B, S_q, H, n_sel]``, ascending, ``-1`` padded (with
    ``cu_seqlens``: block indices local to each document; with ``q_start``: row ``i`` is the query at
    position ``q_start + i`` and the indices are absolute block numbers)."""
    name, impl = pick("select_blocks", backend, (q, k_cmp))
    if cu_seqlens is not None:
        cu, alone = _packed(name, q, cu_seqlens, q_start)
        (out,) = varlen.run_packed(lambda q_, k_: impl(q_, k_, hp, scale=scale),
                                   [q], cu, cmp_rows=[k_cmp], hp=hp, alone_from=alone)
        return out
    res: torch.Tensor = impl(q, k_cmp, hp, scale=scale, q_start=q_start)
    return res


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
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    q_start: int = 0,
    q_win: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gated NSA attention ``[B, S_q, HQ, Dv]``; with ``return_block_idx`` also the blocks used.

    ``q_start``: ``q``, ``gates`` (and ``block_idx``) hold the ``S_q`` query rows at positions
    ``q_start .. q_start + S_q - 1``; the key/value tensors cover positions ``0 .. S_k - 1`` with
    ``S_k >= q_start + S_q`` (``k_cmp``/``v_cmp`` compressed from those ``S_k`` raw rows). Every key
    tensor gets a gradient of all its rows (zero where no query row of the call reads it).

    ``q_win``: the window branch's own queries (``q``'s shape and dtype); ``None``: ``q`` (one query for
    all three branches, the paper's layer)."""
    tensors = (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)
    name, impl = pick("nsa_attention", backend, with_window_query(q, q_win, tensors))
    if cu_seqlens is not None:
        cu, alone = _packed(name, q, cu_seqlens, q_start)
        extra = [t for t in (block_idx, q_win) if t is not None]
        rows = [q, k_sel, v_sel, k_win, v_win, gates, *extra]

        def call(q_: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, kw: torch.Tensor, vw: torch.Tensor,
                 g: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
            it = iter(rest)
            idx = next(it) if block_idx is not None else None
            qw = next(it) if q_win is not None else None
            kc, vc = it
            r: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = impl(
                q_, kc, vc, ks, vs, kw, vw, g, hp, scale=scale, block_idx=idx,
                                                                       return_block_idx=return_block_idx,
                **({} if qw is None else {"q_win": qw}))
            return r

        outs = varlen.run_packed(call, rows, cu, cmp_rows=[k_cmp, v_cmp], hp=hp, alone_from=alone)
        return (outs[0], outs[1]) if return_block_idx else outs[0]
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = impl(
        *tensors, hp, scale=scale, block_idx=block_idx, return_block_idx=return_block_idx, q_start=q_start,
        **({} if q_win is None else {"q_win": q_win}),
    )
    return out


__all__ = [
    "BACKENDS",
    "TUNE_KEYS",
    "NSAParams",
    "available_backends",
    "compress_avg",
    "fallback_counts",
    "nsa_attention",
    "record_fallback",
    "requested_backend",
    "reset_fallback_counts",
    "select_blocks",
    "set_default_backend",
    "tile_overrides",
    "use_backend",
]
