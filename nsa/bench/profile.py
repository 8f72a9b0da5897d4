"""One step under ``torch.profiler``, its kernels totalled by name: the one place that reads the profiler's
kernel times (``nsa bench train --profile-step``, ``nsa bench attention --profile-step`` and the scripts of
``scripts/`` call :func:`profile_kernels`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nsa.bench.step_parts import parts_of

NAME_WIDTH = 90  # a kernel's name is cut to this many characters (templated names run to thousands)


@dataclass
class KernelProfile:
    """What a profiled call ran, per call: ``kernels`` ``{"name", "ms", "launches"}`` by device time, largest
    first (on a CPU: the operators by self CPU time and their calls), every one of them; ``launches`` in all;
    ``parts``: the device time by part (:func:`nsa.bench.step_parts.parts_of`; empty on a CPU)."""

    kernels: list[dict[str, Any]] = field(default_factory=list)
    launches: int = 0
    parts: dict[str, float] = field(default_factory=dict)

    def top(self, n: int = 25) -> list[dict[str, Any]]:
        """The ``n`` heaviest kernels (times rounded to 0.1 us)."""
        return [{**k, "ms": round(k["ms"], 4)} for k in self.kernels[:n]]


def profile_kernels(fn: Callable[[], object], device: torch.device | str, *, reps: int = 1, warmup: int = 0,
                    trace: Path | None = None) -> KernelProfile:
    """Run ``fn`` ``warmup`` times, then ``reps`` times under ``torch.profiler``; the kernels it launched per
    call, totalled by name (:class:`KernelProfile`). ``trace``: the Chrome trace (host and device) of the
    profiled calls written to that file."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(dev)
    acts = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
    with profile(activities=[ProfilerActivity.CPU, *acts] if trace is not None and cuda else acts) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize(dev)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    per: dict[str, list[float]] = {}
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                acc = per.setdefault(e.name.split("(")[0][:NAME_WIDTH], [0.0, 0.0])
                acc[0] += e.device_time_total / 1e3
                acc[1] += 1
    else:
        for avg in prof.key_averages():
            per[avg.key[:NAME_WIDTH]] = [avg.self_cpu_time_total / 1e3, float(avg.count)]
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])
    kernels: list[dict[str, Any]] = [{"name": k, "ms": v[0] / reps, "launches": round(v[1] / reps)}
                                     for k, v in ranked]
    parts = parts_of([(k, v[0] / reps, round(v[1] / reps)) for k, v in ranked]) if cuda else {}
    return KernelProfile(kernels, round(sum(v[1] for v in per.values()) / reps), parts)
