"""Counters of the calls a fast path could not serve (``op:from->to:why``): host-side, no device sync.

Kept apart from :mod:`nsa.ops.dispatch` so that kernels below it (the Triton work list, the split-and-rotate
operator) count their own fallbacks without importing the dispatcher that imports them."""

from __future__ import annotations

from collections import Counter

_fallbacks: Counter[str] = Counter()


def fallback_counts() -> dict[str, int]:
    """How often a requested backend could not serve a call, by reason."""
    return dict(_fallbacks)


def reset_fallback_counts() -> None:
    _fallbacks.clear()


def record_fallback(reason: str) -> None:
    """Count one call that a requested backend could not serve (``op:from->to:why``)."""
    _fallbacks[reason] += 1
