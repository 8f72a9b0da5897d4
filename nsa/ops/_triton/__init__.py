"""Triton kernels of the NSA fast path (used through :mod:`nsa.ops.triton_path`).

Every kernel packs *query rows*: a tile of ``BM`` rows holds ``BM // h`` consecutive positions times the
``h`` query heads of one KV group (row ``r`` is position ``t0 + r // h``, head ``g*h + r % h``). All heads
of a group read the same keys, so a small group is never padded to 16 heads of wasted work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read at import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_SM_COUNT: dict[int, int] = {}


@torch.compiler.assume_constant_result
def _sm_count(index: int) -> int:
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached; a constant inside ``torch.compile``)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_CC_MAJOR: dict[int, int] = {}


@torch.compiler.assume_constant_result
def _cc_major(index: int) -> int:
    if index not in _CC_MAJOR:
        _CC_MAJOR[index] = torch.cuda.get_device_capability(index)[0]
    return _CC_MAJOR[index]


def cc_major(device: torch.device) -> int:
    """Major compute capability of a CUDA device (cached; a constant inside ``torch.compile``)."""
    return _cc_major(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclass(frozen=True)
class TileConfig:
    """Block shapes for one call: rows per tile, keys per tile, warps, pipeline stages."""

    bm: int
    bn: int
    num_warps: int
    num_stages: int


# Overrides for tuning sweeps (``{"sel_bm": 128, ...}``); empty in normal use.
TUNE: dict[str, int | str] = {}


def tile_config(device: torch.device, h: int, dk: int, dv: int, kind: str = "range") -> TileConfig:
    """Heuristic block shapes (GPU) or small ones (the CPU interpreter); ``kind`` range|sel|score."""
    if device.type != "cuda":
        return TileConfig(bm=max(16, next_pow2(h)), bn=16, num_warps=4, num_stages=1)
    dmax = max(next_pow2(dk), next_pow2(dv))
    # measured on an H200 (docs/kernels.md): 4 warps beat 8 for every kernel at D <= 128, except the
    # block scoring of large groups, which also prefers 128-row tiles
    big_score = kind == "score" and h >= 16 and dmax <= 128
    # selection forward of a large group: one position per tile (no union of several positions' blocks)
    bm = int(TUNE.get(f"{kind}_bm", 128 if big_score else 16 if kind == "sel" and h >= 16 else 64))
    bm = max(bm, next_pow2(h))
    bn = int(TUNE.get(f"{kind}_bn", 64 if dmax <= 128 else 32))
    warps = int(TUNE.get(f"{kind}_warps", 8 if big_score or dmax > 128 else 4))
    stages = int(TUNE.get(f"{kind}_stages", 2))
    return TileConfig(bm=bm, bn=bn, num_warps=warps, num_stages=stages)
