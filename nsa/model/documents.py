"""Packed documents in the model: ``cu_seqlens`` over a ``[B, S]`` batch's flattened rows.

Each document is its own sequence: RoPE positions restart at 0 and attention (NSA or dense) never
crosses a boundary (:mod:`nsa.ops.varlen` runs the attention of right-padded length buckets). Every row
start ``b * S`` must be a boundary. Under ``torch.compile`` the per-document attention runs eagerly (a
graph break per layer: its bucket shapes depend on the data); the rest of the model stays compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

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
        raise ValueError(f"cu_seqlens must contain every row start (multiples of seq_len {S}); missing "
                         f"{missing[:4]}")
    return cu


def attend(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], rows: list[torch.Tensor],
           cu_seqlens: torch.Tensor, *, alone_from: int | None = None) -> list[torch.Tensor]:
    """``fn`` (attention of an ordinary ``[n, L, ...]`` batch) over each document of ``rows [B, S, ...]``;
    outputs back as ``[B, S, ...]``. ``alone_from``: each document of at least that many rows in a call of
    its own, unpadded (``n = 1``; 0: every document). Outside ``torch.compile``'s graph (host offsets; one
    graph break)."""
    return outside_graph(_attend)(fn, rows, cu_seqlens, alone_from)


def chunk_spans(cu_seqlens: torch.Tensor, B: int, S: int, start: int,
                stop: int) -> list[tuple[int, int, int]]:
    """``(row, first position in the row, length)`` of each document of a ``[B, S]`` batch (``cu_seqlens``
    over the whole batch) with positions in ``start .. stop - 1`` (host; eager)."""
    cu = offsets(cu_seqlens, B, S)
    return [(a // S, a % S, b - a) for a, b in pairwise(cu)
            if a % S < stop and a % S + (b - a) > start]


_DISABLED: dict[Callable[..., Any], Callable[..., Any]] = {}


def outside_graph(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` under ``torch.compiler.disable`` (run eagerly: the host offsets inside it never become guards),
    wrapped on first use (that imports Dynamo: 7-8 s of every start)."""
    if f not in _DISABLED:
        _DISABLED[f] = torch.compiler.disable(f)
    return _DISABLED[f]


def _attend(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], rows: list[torch.Tensor],
            cu_seqlens: torch.Tensor, alone_from: int | None = None) -> list[torch.Tensor]:
    B, S = rows[0].shape[:2]
    cu = offsets(cu_seqlens, B, S)
    flat = [r.reshape(1, B * S, *r.shape[2:]) for r in rows]
    return [o.reshape(B, S, *o.shape[2:]) for o in varlen.run_packed(fn, flat, cu, alone_from=alone_from)]


def from_separators(ids: torch.Tensor, sep: int) -> torch.Tensor:
    """``cu_seqlens`` (int32) of a ``[B, S]`` batch of packed token rows: a document starts at every row
    start and after every ``sep`` token (the separator ends its document)."""
    B, S = ids.shape
    flat = ids.reshape(-1)
    after = (flat[:-1] == sep).nonzero().flatten() + 1
    starts = torch.cat([torch.arange(0, B * S, S, device=ids.device), after,
                        torch.tensor([B * S], device=ids.device)])
    cu = torch.unique(starts).to(torch.int32)
    torch._dynamo.maybe_mark_dynamic(cu, 0)  # its length changes per batch: one compiled graph for all
    return cu


def chunk_attend(fn: Callable[[list[torch.Tensor], list[torch.Tensor], int], tuple[torch.Tensor, ...]],
                 q_rows: list[torch.Tensor], kv_rows: list[torch.Tensor], cu_seqlens: torch.Tensor,
                 start: int, stop: int) -> list[torch.Tensor]:
    """Packed documents under context parallelism: the query rows ``q_rows [B, stop - start, ...]`` at
    positions
    ``start .. stop - 1`` of a ``[B, S]`` batch whose documents ``cu_seqlens`` bounds (over the whole batch),
    against the key/value rows ``kv_rows [B, S, ...]`` of the whole sequence; outputs ``[B, stop - start,
    ...]``.

    ``fn(q_parts, kv_parts, q_start)`` attends an ordinary batch whose query rows sit at ``q_start`` of its
    keys. Per row of the batch, the document that runs into the chunk from before it goes alone (its queries
    at an offset into its own keys), and the documents that start inside the chunk go together as packed
    documents (:func:`nsa.ops.varlen.run_packed`). Outside ``torch.compile``'s graph, as :func:`attend`."""
    return outside_graph(_chunk_attend)(fn, q_rows, kv_rows, cu_seqlens, start, stop)


def _chunk_attend(fn: Callable[[list[torch.Tensor], list[torch.Tensor], int], tuple[torch.Tensor, ...]],
                  q_rows: list[torch.Tensor], kv_rows: list[torch.Tensor], cu_seqlens: torch.Tensor,
                  start: int, stop: int) -> list[torch.Tensor]:
    B, S = kv_rows[0].shape[:2]
    cu = offsets(cu_seqlens, B, S)
    c, nq = stop - start, len(q_rows)
    into: dict[int, list[torch.Tensor]] = {}  # row b -> outputs of the document running into the chunk
    tails: list[list[torch.Tensor]] = [[] for _ in range(nq + len(kv_rows))]
    cu_tail, lead = [0], []
    for b in range(B):
        bounds = [x - b * S for x in cu if b * S <= x <= (b + 1) * S]
        first = max(x for x in bounds if x <= start)  # where the document holding position `start` begins
        r0 = 0 if first == start else min(min(x for x in bounds if x > start), stop) - start
        lead.append(r0)
        if r0:
            into[b] = list(fn([t[b:b + 1, :r0] for t in q_rows],
                              [t[b:b + 1, first:start + r0] for t in kv_rows],
                               start - first))
        if r0 < c:
            for j, t in enumerate(q_rows):
                tails[j].append(t[b:b + 1, r0:])
            for j, t in enumerate(kv_rows):
                tails[nq + j].append(t[b:b + 1, start + r0:stop])
            base = cu_tail[-1]
            cu_tail += [base + x - start - r0 for x in bounds if start + r0 < x < stop] + [base + c - r0]
    packed: list[torch.Tensor] = []
    if len(cu_tail) > 1:
        flat = [torch.cat(parts, dim=1) for parts in tails]
        packed = varlen.run_packed(lambda *t: fn(list(t[:nq]), list(t[nq:]), 0), flat, cu_tail)
    n_out = len(packed) if packed else len(next(iter(into.values())))
    outs = []
    for k in range(n_out):
        rows, at = [], 0
        for b in range(B):
            pieces = [into[b][k]] if b in into else []
            if lead[b] < c:
                pieces.append(packed[k][:, at:at + c - lead[b]])
                at += c - lead[b]
            rows.append(torch.cat(pieces, dim=1))
        outs.append(torch.cat(rows, dim=0))
    return outs
