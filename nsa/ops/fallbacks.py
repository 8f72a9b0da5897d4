"""Counters of the calls a fast path could not serve (``op:from->to:why``): host-side, no device sync.

Kept apart from :mod:`nsa.ops.dispatch` so that kernels below it (the Triton work list, the split-and-rotate
operator) count their own fallbacks without importing the dispatcher that imports them; :class:`FirstLaunch`
is their one guard against a Triton that cannot compile them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")
_fallbacks: Counter[str] = Counter()


def fallback_counts() -> dict[str, int]:
    """How often a requested backend could not serve a call, by reason."""
    return dict(_fallbacks)


def reset_fallback_counts() -> None:
    _fallbacks.clear()


def record_fallback(reason: str) -> None:
    """Count one call that a requested backend could not serve (``op:from->to:why``)."""
    _fallbacks[reason] += 1


class FirstLaunch:
    """A fast path whose Triton kernels this Triton may not compile: the process's first launch is guarded (a
    compile error, or a ``RuntimeError`` from compiling, sends that call and every later one back to the
    former path, each counted under ``reason`` and the error's class, so every row measured after it shows
    the fallback); once it has run, later launches fail loudly. ``ok``: ``None`` before the first launch,
    then whether it ran."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.ok: bool | None = None
        self.why = reason  # the counter's key once given up: the reason and the error's class

    def run(self, launch: Callable[[], R]) -> R | None:
        """``launch()``, or None where the path is given up (the caller takes the former one)."""
        if self.ok is False:
            record_fallback(self.why)
            return None
        if self.ok:
            return launch()
        from triton.compiler.errors import CompilationError

        try:
            out = launch()
        except (CompilationError, RuntimeError) as exc:
            self.ok, self.why = False, f"{self.reason}:{type(exc).__name__}"
            record_fallback(self.why)
            return None
        self.ok = True
        return out
