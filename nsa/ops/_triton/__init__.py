"""Triton kernels of the NSA fast path (used through :mod:`nsa.ops.triton_path`).

Every kernel packs *query rows*: a tile of ``BM`` rows holds ``BM // h`` consecutive positions times the
``h`` query heads of one KV group (row ``r`` is position ``t0 + r // h``, head ``g*h + r % h``). All heads
of a group read the same keys, so a small group is never padded to 16 heads of wasted work.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read at import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _constant_under_compile(fn: Any) -> Any:
    """``torch.compiler.assume_constant_result`` without importing Dynamo at import time (7-8 s of every
    process's start, compiled or not): the same mark, which ``tests/test_ops.py`` checks is Dynamo's."""
    fn._dynamo_marked_constant = True
    return fn


_SM_COUNT: dict[int, int] = {}


@_constant_under_compile
def _sm_count(index: int) -> int:
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached; a constant inside ``torch.compile``)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_CC_MAJOR: dict[int, int] = {}


@_constant_under_compile
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


# Block-shape keys a tuning sweep may override: ``<kind>_{bm,bn,warps,stages}`` of the attention kernels
# and the named knobs of the compressed backward, the scoring and the decode step.
# range kernels: ``cmp``/``win`` forward, ``...dq``, ``...dkdv``; selection: ``sel`` (forward), ``seldq``,
# ``seldkdv``; ``score``: block scoring
TILE_KINDS = ("cmp", "cmpdq", "cmpdkdv", "win", "windq", "windkdv", "sel", "seldq", "seldkdv", "score")
TUNE_KEYS = frozenset(
    [f"{k}_{x}" for k in TILE_KINDS for x in ("bm", "bn", "warps", "stages")]
    + ["sel_mode", "sel_dq", "sel_ch", "selbwd_ch", "sel_partial_mib", "sel_wl", "rot_launch", "cmp_copy",
       "cmp_bwd_mib", "o3_slots", "sel_tma", "cmp_qch", "score_prec", "score_slab", "score_reshape",
       "score_bj", "score_pad", "topn_elems", "topn_warps", "topn_forced", "topn_key", "dec_waves",
       "dec_cmp_min_tiles", "dec_win_min_tiles", "dec_part_prec", "dec_cmp_warps", "dec_cmp_stages",
       "dec_score_cols", "dec_rank_block", "dec_score_warps", "dec_sel_min_tiles", "dec_sel_warps",
       "dec_sel_stages", "dec_combine_cols", "dec_combine_warps"]
)
# the process's overrides, not a context variable's: the backward of CUDA tensors runs in autograd's device
# thread,
# which a context variable does not reach (a selected-branch order chosen by an override in the forward and
# the
# default one in the backward's trace failed to compile)
_OVERRIDES: list[Mapping[str, int | str]] = [MappingProxyType({})]


@contextlib.contextmanager
def tile_overrides(overrides: Mapping[str, int | str] | None) -> Iterator[None]:
    """Kernel block shapes for the calls inside this block, in every thread of the process (the backward runs
    in autograd's threads), restored at its end (tuning sweeps).

    Keys are :data:`TUNE_KEYS` (``{"sel_bm": 16, "dec_waves": 3}``); an unknown key is a ``ValueError``."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - TUNE_KEYS)
    if unknown:
        raise ValueError(f"unknown tile override {', '.join(unknown)}: choose from "
                         f"{', '.join(sorted(TUNE_KEYS))}")
    before = _OVERRIDES[0]
    _OVERRIDES[0] = MappingProxyType({**before, **overrides})
    try:
        yield
    finally:
        _OVERRIDES[0] = before


@_constant_under_compile
def tuned(key: str, default: int | str) -> int | str:
    """The override of ``key`` in the current :func:`tile_overrides` block, else ``default``; a constant of
    the graph under ``torch.compile`` (Dynamo reads it once, at tracing: inside the compressed branch's
    ``autograd.Function`` it could not trace the lookup)."""
    return _OVERRIDES[0].get(key, default)


@_constant_under_compile
def is_tuned(key: str) -> bool:
    return key in _OVERRIDES[0]


def tile_config(device: torch.device, h: int, dk: int, dv: int, kind: str) -> TileConfig:
    """Heuristic block shapes (GPU) or small ones (the CPU interpreter); ``kind`` one of
    :data:`TILE_KINDS`."""
    if device.type != "cuda":
        return TileConfig(bm=max(16, next_pow2(h)), bn=16, num_warps=4, num_stages=1)
    dmax = max(next_pow2(dk), next_pow2(dv))
    bm, bn, warps, stages = 64, 64 if dmax <= 128 else 32, 4 if dmax <= 128 else 8, 2
    # H100 sweeps (docs/kernels.md, scripts/kernel_sweep.py): 4 warps and 64x64 tiles are best for most
    # kernels at D <= 128; these kinds measured faster with other shapes
    if dmax <= 128:
        if kind == "score" and h >= 16:
            bm = 128  # 4 warps: paper 64k select 9.0 ms against 9.5 with 8 (H200, issue 53)
        elif kind == "cmp" or (kind == "win" and dmax <= 64):
            # the window at D <= 64: m7c 64k 0.648 -> 0.601 ms (H200 sweep, issue 53; at D=128 64x64 stays
            # best: paper 16k 1.149 against 1.272)
            bm, warps, stages = 128, 8, 3
        elif kind == "cmpdkdv" and dmax > 64:
            stages = 1
        elif kind == "windkdv" and dmax <= 64:
            stages = 1  # 64x64, 1 stage: m7c 64k 1.757 -> 1.547 ms against 128x32 (H200 sweep, issue 53)
        elif kind in ("cmpdkdv", "seldkdv") and dmax <= 64:
            bm, bn = 128, 32
        elif kind == "seldkdv":
            stages = 3
    bm = max(int(tuned(f"{kind}_bm", bm)), next_pow2(h))
    bn = int(tuned(f"{kind}_bn", bn))
    warps = int(tuned(f"{kind}_warps", warps))
    stages = int(tuned(f"{kind}_stages", stages))
    return TileConfig(bm=bm, bn=bn, num_warps=warps, num_stages=stages)
