"""Packed documents (``cu_seqlens``, the fla convention): several documents in one batch-1 row.

``cu_seqlens`` is int32/int64 ``[N + 1]``: ``0 = c_0 < c_1 < ... < c_N = T``; document ``n`` is rows
``c_n .. c_{n+1} - 1`` of ``[1, T, ...]`` tensors and behaves exactly as its own sequence starting at
position 0: its own compressed tokens (packed the same way: document ``n`` owns ``N_c(L_n)`` consecutive
rows of ``k_cmp``/``v_cmp``), its own selection blocks (block indices are local to the document), forced
blocks and window. Nothing crosses a boundary.

How it runs: the documents are grouped into length buckets (powers of two, at least ``MIN_BUCKET``),
each bucket right-padded with zero rows to its longest document and run as one ordinary batched call of
the chosen backend; the real rows are copied in and back by host-planned row lists (no gradient ever
accumulates on a shared pad row, no device synchronisation). Right padding is exact: every visibility rule of
NSA is causal, so a real query never sees a padded key, a compressed token that covers padding or a
block past its own position. Gradients flow through the gather and the scatter (autograd). The
reference backend runs each document alone (``alone_from=0``): the definition itself.

The plan needs the lengths on the host: a CUDA ``cu_seqlens`` is copied once per tensor object (one
synchronisation), a CPU one costs nothing. Padding costs at most 2x of a bucket's work; a kernel that
walks documents natively is the faster route (docs/kernels.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from nsa.ops.indexing import num_cmp
from nsa.params import NSAParams

MIN_BUCKET = 64


@dataclass(frozen=True)
class Bucket:
    """Documents run together as a zero-padded ``[n, length]`` batch: ``src`` lists the packed rows of the
    real positions and ``dst`` where each sits in the flattened ``[n * length]`` batch (host-built, so
    moving rows in or out needs no device synchronisation and no gradient lands on a shared pad row)."""

    docs: tuple[int, ...]
    length: int
    src: torch.Tensor
    dst: torch.Tensor


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
        raise ValueError("cu_seqlens must start at 0 and increase strictly, got "
                         f"{cu[:8]}{'...' if len(cu) > 8 else ''}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the packed row has {total} positions")
    return cu


def cmp_offsets(cu: Sequence[int], l: int, d: int) -> list[int]:  # noqa: E741
    """Where each document's compressed tokens start in the packed ``k_cmp`` (and the total at the end)."""
    out = [0]
    for a, b in pairwise(cu):
        out.append(out[-1] + num_cmp(b - a, l, d))
    return out


def _bucket(docs: list[int], starts: list[int], lengths: list[int], length: int,
            device: torch.device) -> Bucket:
    pos = torch.arange(length)
    real = (pos[None] < torch.tensor(lengths)[:, None]).reshape(-1)
    src = (torch.tensor(starts)[:, None] + pos[None]).reshape(-1)[real]
    dst = torch.arange(real.numel())[real]
    return Bucket(tuple(docs), length, src.to(device), dst.to(device))


@functools.lru_cache(maxsize=64)
def _plan(cu: tuple[int, ...], device: torch.device, alone_from: int | None) -> tuple[Bucket, ...]:
    lengths = [b - a for a, b in pairwise(cu)]
    groups: dict[int, list[int]] = {}
    for n, length in enumerate(lengths):  # a document alone: key -1 - n, apart from every length bucket
        alone = alone_from is not None and length >= alone_from
        groups.setdefault(-1 - n if alone else max(MIN_BUCKET, 1 << (length - 1).bit_length()), []).append(n)
    return tuple(_bucket(docs, [cu[n] for n in docs], [lengths[n] for n in docs],
                         max(lengths[n] for n in docs), device)
                 for docs in (groups[k] for k in sorted(groups)))


def plan(cu: Sequence[int], device: torch.device, *, alone_from: int | None = None) -> list[Bucket]:
    """Group the documents of ``cu`` into buckets by length, each document of at least ``alone_from`` rows in
    one of its own (0: every document); cached per offsets, so the layers of one packed batch share one
    plan."""
    return list(_plan(tuple(cu), device, alone_from))


def take(x: torch.Tensor, b: Bucket) -> torch.Tensor:
    """Rows of packed ``x [1, T, ...]`` as the bucket's zero-padded batch ``[n, length, ...]``."""
    n = len(b.docs)
    out = x.new_zeros(n * b.length, *x.shape[2:])
    return out.index_copy(0, b.dst, x[0].index_select(0, b.src)).view(n, b.length, *x.shape[2:])


def scatter(parts: list[torch.Tensor], buckets: list[Bucket], total: int) -> torch.Tensor:
    """Inverse of :func:`take`: the real rows of each bucket's ``[n, L, ...]`` back in packed order ``[1, T,
    ...]``."""
    shape = parts[0].shape[2:]
    out = parts[0].new_empty(total, *shape)
    for p, b in zip(parts, buckets, strict=True):
        out = out.index_copy(0, b.src, p.reshape(p.shape[0] * p.shape[1], *shape).index_select(0, b.dst))
    return out[None]


def cmp_bucket(bucket: Bucket, cmp_cu: Sequence[int], l: int, d: int) -> Bucket:  # noqa: E741
    """The bucket's documents over the packed compressed tokens, each padded to ``N_c(length)``."""
    return _cmp_bucket(bucket.docs, bucket.length, bucket.src.device, tuple(cmp_cu), l, d)


@functools.lru_cache(maxsize=64)
def _cmp_bucket(docs: tuple[int, ...], length: int, device: torch.device, cmp_cu: tuple[int, ...],
                l: int,  # noqa: E741
                d: int) -> Bucket:
    return _bucket(list(docs), [cmp_cu[n] for n in docs], [cmp_cu[n + 1] - cmp_cu[n] for n in docs],
                   num_cmp(length, l, d), device)


def run_packed(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    rows: Sequence[torch.Tensor],
    cu: Sequence[int],
    *,
    cmp_rows: Sequence[torch.Tensor] = (),
    hp: NSAParams | None = None,
    alone_from: int | None = None,
) -> list[torch.Tensor]:
    """``fn(*padded rows, *padded compressed rows)`` per bucket (:func:`plan`); each output ``[n, L, ...]``
    scattered back to ``[1, T, ...]``. ``rows`` are packed per-position tensors, ``cmp_rows`` packed
    compressed tokens (the block ``hp.l`` and stride ``hp.d`` say how many each document owns)."""
    total = cu[-1]
    device = rows[0].device
    buckets = plan(cu, device, alone_from=alone_from)
    if cmp_rows and hp is None:
        raise ValueError("run_packed: compressed rows need the NSA hyper-parameters (hp)")
    l, d = (hp.l, hp.d) if hp is not None else (1, 1)  # noqa: E741
    cmp_cu = cmp_offsets(cu, l, d) if cmp_rows else []
    outs: list[list[torch.Tensor]] = []
    for b in buckets:
        args = [take(x, b) for x in rows]
        if cmp_rows:
            cb = cmp_bucket(b, cmp_cu, l, d)
            args += [take(x, cb) for x in cmp_rows]
        res = fn(*args)
        outs.append(list(res) if isinstance(res, tuple) else [res])
    return [scatter([o[i] for o in outs], buckets, total) for i in range(len(outs[0]))]


def compress_packed(
    compress: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, cu: Sequence[int], hp: NSAParams,
    *, alone_from: int | None = None,
) -> torch.Tensor:
    """Packed compressed tokens ``[1, sum N_c(L_n), ...]`` of packed raw rows ``x [1, T, ...]``."""
    l, d = hp.l, hp.d  # noqa: E741
    cmp_cu = cmp_offsets(cu, l, d)
    if cmp_cu[-1] == 0:
        return x.new_zeros(1, 0, *x.shape[2:])
    buckets = plan(cu, x.device, alone_from=alone_from)
    parts = [compress(take(x, b)) for b in buckets]  # [n, N_c(length), ...]
    return scatter(parts, [cmp_bucket(b, cmp_cu, l, d) for b in buckets], cmp_cu[-1])


def positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed row's position inside its document (``[T]``, int64), with tensor ops only (no host copy).

    Under ``torch.compile`` the start of each row's document is the largest boundary at or before it, a
    reduction Inductor fuses: torch 2.11's Inductor fails to lower ``searchsorted`` over a slice of a
    dynamic-length ``cu_seqlens`` (``NotImplementedError: SliceView``); eager keeps the ``O(T log n)``
    search."""
    cu = cu_seqlens.to(torch.long)
    t = torch.arange(total, device=cu.device)
    if torch.compiler.is_compiling():
        start = torch.where(cu[None, :] <= t[:, None], cu[None, :], 0).amax(dim=1)
        return t - start
    doc = torch.searchsorted(cu[1:], t, right=True)
    return t - cu[doc]
