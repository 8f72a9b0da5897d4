"""Several benchmark runs at once, each in a process of its own: on CUDA each process sees one GPU
(``CUDA_VISIBLE_DEVICES``, dealt round-robin, so more runs than GPUs share them), on CPU a share of the
cores."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

import torch

from nsa.errors import ConfigError

R = TypeVar("R")


def slots(n: int) -> tuple[list[str], bool]:
    """What each of ``n`` processes gets, and whether they are GPUs: the visible GPUs
    (``CUDA_VISIBLE_DEVICES`` entries, or device numbers) dealt round-robin, else a thread count each (more
    processes than CPU cores: refused)."""
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = ([g for g in visible.split(",") if g.strip()] if visible
                else [str(i) for i in range(torch.cuda.device_count())])
        return [gpus[i % len(gpus)] for i in range(n)], True
    cores = os.cpu_count() or 1
    if n > cores:
        raise ConfigError(f"--parallel {n} needs {n} CPU cores (one run each); {cores} here",
                          hint=f"pass --parallel {cores} or fewer")
    return [str(max(1, cores // n))] * n, False


class RunFailed(RuntimeError):
    """A run that failed in its worker process: its error and traceback as text (whatever the error held,
    this pickles back to the parent)."""


def _guarded(worker: Callable[..., R], *job: Any) -> R:
    try:
        return worker(*job)
    except BaseException as exc:  # the original may not pickle (a module in its arguments): send its text
        raise RunFailed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}") from None


def _pin(queue: Any, cuda: bool) -> None:
    """A worker's initializer: take one slot, its GPU (before CUDA starts in this process) or its threads."""
    slot = queue.get()
    if cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = slot
    else:
        torch.set_num_threads(int(slot))


def spread(worker: Callable[..., R], jobs: Sequence[tuple[Any, ...]], n: int, *,
           on_start: Callable[[str], None] | None = None,
           on_done: Callable[[int, R], None] | None = None) -> list[R]:
    """``worker(*job)`` for every job, ``n`` at a time in spawned processes (:func:`slots`); results in the
    order of ``jobs``. ``worker`` must be a module-level function (it is pickled by name). ``on_done(i,
    result)`` hears each job as it ends. The first job to fail drops the ones not started; the ones already
    running finish and reach ``on_done`` (a sweep keeps what it paid for), then that first failure is
    raised."""
    given, cuda = slots(n)
    if on_start is not None:
        where = f"on GPUs {','.join(given)}" if cuda else f"{len(given)} processes"
        on_start(f"{len(jobs)} runs, {n} at a time ({where})")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    for slot in given:
        queue.put(slot)
    results: dict[int, R] = {}
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_pin, initargs=(queue, cuda)) as pool:
        futures = {pool.submit(_guarded, worker, *job): i for i, job in enumerate(jobs)}
        failed: BaseException | None = None
        for fut in as_completed(futures):
            if fut.cancelled():
                continue
            try:
                result = fut.result()
            except BaseException as exc:
                if failed is None:
                    failed = exc
                    for other in futures:
                        other.cancel()  # only the ones not started yet
                continue
            results[futures[fut]] = result
            if on_done is not None:
                on_done(futures[fut], result)
    if failed is not None:
        raise failed
    return [results[i] for i in range(len(jobs))]
