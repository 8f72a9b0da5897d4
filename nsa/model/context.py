"""Context parallelism: one sequence split over the ranks of a group, each rank holding its own positions.

Layout: the ``S`` positions in ``2N`` chunks of ``S / 2N``; rank ``r`` of ``N`` holds chunks ``r`` and
``2N - 1 - r`` (head and tail: the compressed branch and the block scoring cost grows with the position, the
selected and window branches do not, so every rank gets one cheap and one dear chunk). Every layer projects
its own rows; an attention layer all-gathers the keys and values of the whole sequence (their gradients
reduce-scattered in float32 back to the rows' owners) and attends from each of its chunks to the prefix that
ends with the chunk (``nsa.ops.nsa_attention(..., q_start=...)``). Everything else in the model is per row.

The model knows no process groups of its own: :class:`ContextParallel` carries the group the trainer made
(``None`` with ``size == 1``: a world of one, the same arithmetic without communication).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as fc

# functional collectives (newer torch names them *_single; torch 2.11 has only the *_tensor spellings)
_ALL_GATHER = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
_REDUCE_SCATTER = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor


def _waited(t: torch.Tensor) -> torch.Tensor:
    return fc.wait_tensor(t) if isinstance(t, fc.AsyncCollectiveTensor) else t


def _gather_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All ranks' ``x`` concatenated along dim 0 (rank order)."""
    return _waited(_ALL_GATHER(x.contiguous(), 0, group))


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather along dim 0 in the input's dtype. Backward: the gradient reduce-scattered (summed
    over the ranks) in float32 at least, each rank receiving its own rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.dtype = group, x.dtype
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        wide = grad.to(torch.promote_types(grad.dtype, torch.float32))  # bf16 gradients summed in float32
        out = _waited(_REDUCE_SCATTER(wide.contiguous(), "sum", 0, ctx.group))
        return out.to(ctx.dtype), None


@dataclass(frozen=True)
class ContextParallel:
    """This rank's share of a sequence split over ``size`` ranks (see the module docstring)."""

    group: Any
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"context-parallel rank {self.rank} of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("context parallelism over several ranks needs their process group")

    def check(self, seq_len: int) -> None:
        """``seq_len`` must split into ``2 * size`` equal chunks."""
        if seq_len % (2 * self.size):
            raise ValueError(f"a sequence of {seq_len} positions does not split into {2 * self.size} equal "
                             f"chunks (context parallelism over {self.size} ranks)")

    def chunks(self, seq_len: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of this rank's chunks, in the order its rows hold them."""
        self.check(seq_len)
        n, c = 2 * self.size, seq_len // (2 * self.size)
        return [(self.rank * c, (self.rank + 1) * c), ((n - 1 - self.rank) * c, (n - self.rank) * c)]

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The absolute positions of this rank's rows: ``[seq_len / size]`` int64."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.chunks(seq_len)])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's rows of a whole-sequence tensor (``x.shape[dim] == seq_len``)."""
        return x.index_select(dim, self.positions(x.shape[dim], x.device))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence ``[B, S, ...]`` in position order from every rank's rows ``[B, S / size, ...]``
        (differentiable: the gradient of a rank's rows is the sum over the ranks that used them)."""
        if self.size == 1:
            return x
        rows = _GatherSequence.apply(x.transpose(0, 1), self.group)  # [size * S_local, B, ...], rank-major
        return in_position_order(rows, self.size).transpose(0, 1)


def in_position_order(rows: torch.Tensor, size: int) -> torch.Tensor:
    """Gathered rows ``[S, ...]`` in rank-major order (rank 0's head and tail chunks, then rank 1's, ...) put
    in position order along dim 0: the heads of ranks 0 .. size-1, then the tails of ranks size-1 .. 0 (one
    copy)."""
    c = rows.shape[0] // (2 * size)
    held = rows.view(size, 2, c, *rows.shape[1:])  # [rank, head/tail, chunk rows, ...]
    return torch.cat([held[r, 0] for r in range(size)] + [held[r, 1] for r in reversed(range(size))])
