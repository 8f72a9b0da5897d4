"""Median timings for the benchmarks: CUDA events through ``triton.testing.do_bench``, else a host clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

Timer = Callable[[Callable[[], Any]], float]


def make_timer(device: torch.device, warmup_ms: int = 25, rep_ms: int = 100, cpu_reps: int = 5) -> Timer:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on CUDA, ``perf_counter`` on CPU."""
    if device.type == "cuda":
        import triton.testing

        def cuda_time(fn: Callable[[], Any]) -> float:
            return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

        return cuda_time

    def cpu_time(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(cpu_reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu_time
