"""NSA functional ops: the public kernel-level API, the same call for every backend.

``compress_avg(x, hp)``, ``select_blocks(q, k_cmp, hp, *, scale=None)`` and
``nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, hp, *, scale=None, block_idx=None)``
with ``hp`` an :class:`NSAParams` (the five hyper-parameters as one frozen object); see
``docs/nsa-semantics.md`` for what they compute. Each also takes ``backend=`` (``auto``, ``reference``,
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
    fallback_counts,
    pick,
    record_fallback,
    requested_backend,
    reset_fallback_counts,
    set_default_backend,
    use_backend,
)
from nsa.params import NSAParams


def _packed(name: str, x: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[list[int], bool]:
    """The host offsets, and whether each document runs alone (the reference: the definition itself)."""
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a batch-1 packed row, got batch {x.shape[0]}")
    return varlen.host_offsets(cu_seqlens, x.shape[1]), name == "reference"


def compress_avg(
    x: torch.Tensor, hp: NSAParams, *, backend: str | None = None, cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean-pool raw ``x [B, S, H, D]`` into compressed tokens ``[B, S_cmp, H, D]`` (block ``l``, stride ``d``)."""
    name, impl = pick("compress_avg", backend, (x,))
    if cu_seqlens is not None:
        cu, one = _packed(name, x, cu_seqlens)
        return varlen.compress_packed(lambda t: impl(t, hp), x, cu, hp, per_document=one)
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
) -> torch.Tensor:
    """Selection blocks per query and group: int32 ``[B, S, H, n_sel]``, ascending, ``-1`` padded (with
    ``cu_seqlens``: block indices local to each document)."""
    name, impl = pick("select_blocks", backend, (q, k_cmp))
    if cu_seqlens is not None:
        cu, one = _packed(name, q, cu_seqlens)
        (out,) = varlen.run_packed(lambda q_, k_: impl(q_, k_, hp, scale=scale),
                                   [q], cu, cmp_rows=[k_cmp], hp=hp, per_document=one)
        return out
    res: torch.Tensor = impl(q, k_cmp, hp, scale=scale)
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gated NSA attention ``[B, S, HQ, Dv]``; with ``return_block_idx`` also the blocks used."""
    if q_start:  # TEMPORARY development shim (helper branch brings the real one): pad the queries in front
        pad = lambda t: torch.cat([t.new_zeros(t.shape[0], q_start, *t.shape[2:]), t], dim=1)  # noqa: E731
        r = nsa_attention(pad(q), k_cmp, v_cmp, k_sel[:, :q_start + q.shape[1]], v_sel[:, :q_start + q.shape[1]],
                          k_win[:, :q_start + q.shape[1]], v_win[:, :q_start + q.shape[1]], pad(gates), hp,
                          scale=scale, return_block_idx=return_block_idx, backend=backend)
        return (r[0][:, q_start:], r[1][:, q_start:]) if isinstance(r, tuple) else r[:, q_start:]
    tensors = (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)
    name, impl = pick("nsa_attention", backend, tensors)
    if cu_seqlens is not None:
        cu, one = _packed(name, q, cu_seqlens)
        rows = [q, k_sel, v_sel, k_win, v_win, gates, *([] if block_idx is None else [block_idx])]

        def call(q_: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, kw: torch.Tensor, vw: torch.Tensor,
                 g: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
            idx, (kc, vc) = (rest[0], rest[1:]) if block_idx is not None else (None, rest)
            r: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = impl(
                q_, kc, vc, ks, vs, kw, vw, g, hp, scale=scale, block_idx=idx, return_block_idx=return_block_idx)
            return r

        outs = varlen.run_packed(call, rows, cu, cmp_rows=[k_cmp, v_cmp], hp=hp, per_document=one)
        return (outs[0], outs[1]) if return_block_idx else outs[0]
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = impl(
        *tensors, hp, scale=scale, block_idx=block_idx, return_block_idx=return_block_idx,
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
