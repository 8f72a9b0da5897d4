"""Triton kernels of the NSA fast path (used through :mod:`nsa.ops.triton_path`).

Every kernel packs *query rows*: a tile of ``BM`` rows holds ``BM // h`` consecutive positions times the
``h`` query heads of one KV group (row ``r`` is position ``t0 + r // h``, head ``g*h + r % h``). All heads
of a group read the same keys, so a small group is never padded to 16 heads of wasted work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclass(frozen=True)
class TileConfig:
    """Block shapes for one call: rows per tile, keys per tile, warps, pipeline stages."""

    bm: int
    bn: int
    num_warps: int
    num_stages: int


def tile_config(device: torch.device, h: int, dk: int, dv: int) -> TileConfig:
    """Heuristic block shapes (GPU) or small ones (the CPU interpreter)."""
    if device.type != "cuda":
        return TileConfig(bm=max(16, next_pow2(h)), bn=16, num_warps=4, num_stages=1)
    dmax = max(next_pow2(dk), next_pow2(dv))
    bm = max(64, next_pow2(h))
    bn = 64 if dmax <= 128 else 32
    return TileConfig(bm=bm, bn=bn, num_warps=4 if dmax <= 64 else 8, num_stages=2)
