"""``nsa.bench.fanout``: runs in processes of their own, and a failed run's error reaching the parent."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from nsa.bench import fanout


def _square(x: int) -> int:
    return x * x


def _fails_or_waits(x: int) -> int:
    if x < 0:
        raise ValueError("no negatives")
    time.sleep(x)
    return x


def _fails_holding_a_module(x: int) -> int:
    raise ValueError(f"run {x} went wrong", os)  # a module among the arguments: the error itself does not pickle


def _square_when(x: int, wait_for: str | None, then_create: str | None) -> int:
    """``x * x``, returned once the file ``wait_for`` exists (at most 120 s), after creating ``then_create``."""
    deadline = time.monotonic() + 120
    while wait_for is not None and not os.path.exists(wait_for):
        if time.monotonic() > deadline:
            raise TimeoutError(wait_for)
        time.sleep(0.01)
    if then_create is not None:
        open(then_create, "w").close()
    return x * x


def test_results_come_back_in_job_order(tmp_path: Path) -> None:
    """The first job ends last (it waits for the file the third one creates; two workers): the jobs finish in
    the order 1, 2, 0, and the results still come back in job order."""
    flag = str(tmp_path / "third-done")
    done: list[int] = []
    jobs = [(3, flag, None), (1, None, None), (2, None, flag)]
    assert fanout.spread(_square_when, jobs, 2, on_done=lambda i, r: done.append(i)) == [9, 1, 4]
    assert done == [1, 2, 0]


def test_an_error_that_does_not_pickle_reaches_the_parent_as_text() -> None:
    """Before: the parent saw only "TypeError: cannot pickle 'module' object" (an Inductor error in a GPU
    curriculum run was hidden so)."""
    with pytest.raises(fanout.RunFailed, match=r"ValueError: \('run 5 went wrong'") as info:
        fanout.spread(_fails_holding_a_module, [(5,)], 1)
    assert "_fails_holding_a_module" in str(info.value)  # the worker's traceback comes along


def test_runs_already_going_when_one_fails_still_report() -> None:
    """A failing run (at once) beside a slower one: the slower one's result still reaches ``on_done`` before
    the failure is raised (the runs not yet started are cancelled, as far as the pool has not handed them on
    already: not asserted, it depends on timing). Before, the running ones were waited for and
    their results thrown away (a GPU sweep lost every finished arm to one failing arm)."""
    done: list[tuple[int, int]] = []
    with pytest.raises(fanout.RunFailed, match="no negatives"):
        fanout.spread(_fails_or_waits, [(-1,), (2,), *[(0,)] * 6], 2, on_done=lambda i, r: done.append((i, r)))
    assert (1, 2) in done
