"""Packed documents (``cu_seqlens``, the fla convention): several documents in one batch-1 row.

``cu_seqlens`` is int32/int64 ``[N + 1]``: ``0 = c_0 < c_1 < ... < c_N = T``; document ``n`` is rows
``c_n .. c_{n+1} - 1`` of ``[1, T, ...]`` tensors and behaves exactly as its own sequence starting at
position 0: its own compressed tokens (packed the same way: document ``n`` owns ``N_c(L_n)`` consecutive
rows of ``k_cmp``/``v_cmp``), its own selection blocks (block indices are local to the document), forced
blocks and window. Nothing crosses a boundary.

How it runs: the documents are grouped into length buckets (powers of two, at least ``MIN_BUCKET``),
each bucket right-padded with zero rows to its longest document and run as one ordinary batched call of
the chosen backend; the real rows are scattered back. Right padding is exact: every visibility rule of
NSA is causal, so a real query never sees a padded key, a compressed token that covers padding or a
block past its own position. Gradients flow through the gather and the scatter (autograd). The
reference backend runs each document alone (``per_document=True``): the definition itself.

The plan needs the lengths on the host: a CUDA ``cu_seqlens`` is copied once per tensor object (one
synchronisation), a CPU one costs nothing. Padding costs at most 2x of a bucket's work; a kernel that
walks documents natively is the faster route (docs/kernels.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from nsa.ops.indexing import num_cmp

MIN_BUCKET = 64


@dataclass(frozen=True)
class Bucket:
    """Documents run together: ``index [n, length]`` holds the global row of each padded position (``pad``
    for padding, which points at an appended zero row); ``real`` masks the real positions."""

    docs: tuple[int, ...]
    length: int
    index: torch.Tensor
    real: torch.Tensor


def host_offsets(cu_seqlens: torch.Tensor | Sequence[int], total: int | None = None) -> list[int]:
    """``cu_seqlens`` as a checked host list (``total``: the packed length it must end at)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-d int32/int64 tensor, got {tuple(cu_seqlens.shape)} "
                             f"{str(cu_seqlens.dtype).removeprefix('torch.')}")
        # one device copy per tensor object however many layers read it; an in-place write (a new
        # ``_version``) invalidates the copy
        cached = getattr(cu_seqlens, "_nsa_host", None)
        if cached is not None and cached[0] == cu_seqlens._version:
            cu = cached[1]
        else:
            cu = [int(c) for c in cu_seqlens.tolist()]
            with contextlib.suppress(AttributeError, RuntimeError):
                cu_seqlens._nsa_host = (cu_seqlens._version, cu)  # type: ignore[attr-defined]
    else:
        cu = [int(c) for c in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in pairwise(cu)):
        raise ValueError(f"cu_seqlens must start at 0 and increase strictly, got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the packed row has {total} positions")
    return cu


def cmp_offsets(cu: Sequence[int], l: int, d: int) -> list[int]:  # noqa: E741
    """Where each document's compressed tokens start in the packed ``k_cmp`` (and the total at the end)."""
    out = [0]
    for a, b in pairwise(cu):
        out.append(out[-1] + num_cmp(b - a, l, d))
    return out


def plan(cu: Sequence[int], device: torch.device, *, per_document: bool = False) -> list[Bucket]:
    """Group the documents of ``cu`` into buckets (one per document with ``per_document``)."""
    lengths = [b - a for a, b in pairwise(cu)]
    total = cu[-1]
    groups: dict[int, list[int]] = {}
    for n, L in enumerate(lengths):
        key = n if per_document else max(MIN_BUCKET, 1 << (L - 1).bit_length())
        groups.setdefault(key, []).append(n)
    buckets = []
    for key in sorted(groups):
        docs = groups[key]
        length = max(lengths[n] for n in docs)
        pos = torch.arange(length)
        starts = torch.tensor([cu[n] for n in docs])[:, None]
        lens = torch.tensor([lengths[n] for n in docs])[:, None]
        real = pos[None] < lens
        index = torch.where(real, starts + pos[None], torch.full_like(pos[None], total))
        buckets.append(Bucket(tuple(docs), length, index.to(device), real.to(device)))
    return buckets


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of packed ``x [1, T, ...]`` at ``index [n, L]`` (``T``: a zero row): ``[n, L, ...]``."""
    flat = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])
    return flat[index]


def scatter(parts: list[torch.Tensor], buckets: list[Bucket], total: int) -> torch.Tensor:
    """Inverse of :func:`gather`: the real rows of each bucket's ``[n, L, ...]`` back in packed order ``[1, T, ...]``."""
    rows = torch.cat([p[b.real] for p, b in zip(parts, buckets, strict=True)])
    where = torch.cat([b.index[b.real] for b in buckets])
    order = torch.empty_like(where)
    order[where] = torch.arange(total, device=where.device)
    return rows[order][None]


def cmp_index(bucket: Bucket, cmp_cu: Sequence[int], l: int, d: int) -> torch.Tensor:  # noqa: E741
    """Rows of the packed compressed tokens for each document of ``bucket``, padded to ``N_c(length)``."""
    n_c = num_cmp(bucket.length, l, d)
    j = torch.arange(n_c)
    rows = []
    for n in bucket.docs:
        have = cmp_cu[n + 1] - cmp_cu[n]
        rows.append(torch.where(j < have, cmp_cu[n] + j, torch.full_like(j, cmp_cu[-1])))
    return torch.stack(rows).to(bucket.index.device) if rows else bucket.index.new_zeros(0, n_c)


def run_packed(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    rows: Sequence[torch.Tensor],
    cu: Sequence[int],
    *,
    cmp_rows: Sequence[torch.Tensor] = (),
    l: int = 1,  # noqa: E741
    d: int = 1,
    per_document: bool = False,
) -> list[torch.Tensor]:
    """``fn(*padded rows, *padded compressed rows)`` per bucket; each output ``[n, L, ...]`` scattered back to
    ``[1, T, ...]``. ``rows`` are packed per-position tensors, ``cmp_rows`` packed compressed tokens (their
    block ``l`` and stride ``d`` say how many each document owns)."""
    total = cu[-1]
    device = rows[0].device
    buckets = plan(cu, device, per_document=per_document)
    cmp_cu = cmp_offsets(cu, l, d) if cmp_rows else []
    outs: list[list[torch.Tensor]] = []
    for b in buckets:
        args = [gather(x, b.index) for x in rows]
        if cmp_rows:
            ci = cmp_index(b, cmp_cu, l, d)
            args += [gather(x, ci) for x in cmp_rows]
        res = fn(*args)
        outs.append(list(res) if isinstance(res, tuple) else [res])
    return [scatter([o[i] for o in outs], buckets, total) for i in range(len(outs[0]))]


def compress_packed(
    compress: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, cu: Sequence[int], l: int, d: int,  # noqa: E741
    *, per_document: bool = False,
) -> torch.Tensor:
    """Packed compressed tokens ``[1, sum N_c(L_n), ...]`` of packed raw rows ``x [1, T, ...]``."""
    cmp_cu = cmp_offsets(cu, l, d)
    buckets = plan(cu, x.device, per_document=per_document)
    rows: list[torch.Tensor] = []
    where: list[int] = []
    for b in buckets:
        c = compress(gather(x, b.index))  # [n, N_c(length), ...]
        for i, n in enumerate(b.docs):
            have = cmp_cu[n + 1] - cmp_cu[n]
            rows.append(c[i, :have])
            where.extend(range(cmp_cu[n], cmp_cu[n + 1]))
    if not rows:
        return x.new_zeros(1, 0, *x.shape[2:])
    out = torch.cat(rows)
    order = torch.empty(len(where), dtype=torch.long)
    order[torch.tensor(where, dtype=torch.long)] = torch.arange(len(where))
    return out[order.to(x.device)][None]


def positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed row's position inside its document (``[T]``, int64), with tensor ops only (no host copy)."""
    cu = cu_seqlens.to(torch.long)
    t = torch.arange(total, device=cu.device)
    doc = torch.searchsorted(cu[1:], t, right=True)
    return t - cu[doc]
