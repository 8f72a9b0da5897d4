"""Median timings for the benchmarks: CUDA events through ``triton.testing.do_bench``, else a host clock."""

from __future__ import annotations

import fcntl
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

NOISE_LIMIT = 0.2  # a timing whose repetitions spread more than this around their median is too noisy to read


class Timer:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on CUDA (its 20th and 80th percentiles give
    the spread), ``perf_counter`` repetitions on CPU (their min and max). ``spread`` of the last timing:
    (high - low) / median."""

    def __init__(self, device: torch.device, warmup_ms: int = 25, rep_ms: int = 100,
                 cpu_reps: int = 5) -> None:
        self.device, self.warmup_ms, self.rep_ms, self.cpu_reps = device, warmup_ms, rep_ms, cpu_reps
        self.spread: float = 0.0

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            import triton.testing

            lo, med, hi = (float(x) for x in triton.testing.do_bench(
                fn, warmup=self.warmup_ms, rep=self.rep_ms, quantiles=[0.2, 0.5, 0.8]))
        else:
            fn()
            times = []
            for _ in range(self.cpu_reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            lo, med, hi = min(times), statistics.median(times), max(times)
        self.spread = (hi - lo) / med if med > 0 else 0.0
        return med


def make_timer(device: torch.device, warmup_ms: int = 25, rep_ms: int = 100, cpu_reps: int = 5) -> Timer:
    """A :class:`Timer` for ``device``."""
    return Timer(device, warmup_ms, rep_ms, cpu_reps)


def noise_note(what: str, spread: float, limit: float = NOISE_LIMIT) -> str | None:
    """A warning when a timing's repetitions spread more than ``limit`` around their median."""
    if spread <= limit:
        return None
    return (f"{what} timings spread {spread:.0%} around their median (> {limit:.0%}): too noisy to read; "
            "stop other work on the machine or raise --rep-ms")


@contextmanager
def device_turn(tag: str = "nsa-bench") -> Iterator[None]:
    """This process's turn on its GPU: an exclusive lock shared by every process of this machine that times on
    the same ``CUDA_VISIBLE_DEVICES`` (a file lock in the temporary folder, released when the process ends).
    Processes that compile side by side (CPU-bound) time one at a time, so no timing shares the GPU."""
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "_") or "none"
    path = Path(tempfile.gettempdir()) / f"{tag}-gpu-{gpu}.lock"
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def parse_tune(items: list[str] | None) -> dict[str, int | str]:
    """``--tune key=value`` overrides of the Triton block shapes (tuning sweeps), checked against
    :data:`nsa.ops.TUNE_KEYS` (numbers as ints); passed to a benchmark, nothing global is changed."""
    from nsa.errors import ConfigError
    from nsa.ops import TUNE_KEYS

    out: dict[str, int | str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--tune {item!r} must be key=value", hint="e.g. --tune sel_bm=16")
        if key not in TUNE_KEYS:
            raise ConfigError(f"--tune {key} is not a tile setting",
                              hint=f"one of {', '.join(sorted(TUNE_KEYS))}")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out
