"""Packed documents in the model: ``cu_seqlens`` over a ``[B, S]`` batch's flattened rows.

Each document is its own sequence: RoPE positions restart at 0 and attention (NSA or dense) never
crosses a boundary (:mod:`nsa.ops.varlen` runs the attention of right-padded length buckets). Every row
start ``b * S`` must be a boundary. Under ``torch.compile`` the per-document attention runs eagerly (a
graph break per layer: its bucket shapes depend on the data); the rest of the model stays compiled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nsa.ops import varlen


def positions(cu_seqlens: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """``[B, S]`` positions of every row inside its document (tensor ops: traced by ``torch.compile``)."""
    return varlen.positions(cu_seqlens, B * S).view(B, S)


def offsets(cu_seqlens: torch.Tensor, B: int, S: int) -> list[int]:
    """The checked host list: strictly increasing from 0 to ``B*S``, every row start a boundary."""
    cu = varlen.host_offsets(cu_seqlens, B * S)
    missing = sorted(set(range(0, B * S, S)) - set(cu))
    if missing:
        raise ValueError(f"cu_seqlens must contain every row start (multiples of seq_len {S}); missing {missing[:4]}")
    return cu


def attend(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], rows: list[torch.Tensor],
           cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """``fn`` (attention of an ordinary ``[n, L, ...]`` batch) over each document of ``rows [B, S, ...]``;
    outputs back as ``[B, S, ...]``. Outside ``torch.compile``'s graph (host offsets; one graph break)."""
    if not _EAGER:  # wrapped on first use: torch.compiler.disable imports Dynamo (7-8 s of every start)
        _EAGER.append(torch.compiler.disable(_attend))
    return _EAGER[0](fn, rows, cu_seqlens)


_EAGER: list[Callable[..., list[torch.Tensor]]] = []


def _attend(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], rows: list[torch.Tensor],
            cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    B, S = rows[0].shape[:2]
    cu = offsets(cu_seqlens, B, S)
    flat = [r.reshape(1, B * S, *r.shape[2:]) for r in rows]
    return [o.reshape(B, S, *o.shape[2:]) for o in varlen.run_packed(fn, flat, cu)]


def from_separators(ids: torch.Tensor, sep: int) -> torch.Tensor:
    """``cu_seqlens`` (int32) of a ``[B, S]`` batch of packed token rows: a document starts at every row
    start and after every ``sep`` token (the separator ends its document)."""
    B, S = ids.shape
    flat = ids.reshape(-1)
    after = (flat[:-1] == sep).nonzero().flatten() + 1
    starts = torch.cat([torch.arange(0, B * S, S, device=ids.device), after, torch.tensor([B * S], device=ids.device)])
    cu = torch.unique(starts).to(torch.int32)
    torch._dynamo.maybe_mark_dynamic(cu, 0)  # its length changes per batch: one compiled graph for all
    return cu
