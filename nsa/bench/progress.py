"""Progress of a long benchmark (several training runs): the share done and an ETA from the pace so far."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable


def duration(seconds: float | None) -> str:
    return "?" if seconds is None else str(datetime.timedelta(seconds=round(seconds)))


class Eta:
    """``total`` units of work (training steps of every run); :meth:`line` says how far ``done`` units are and
    when the rest should be done at the pace so far (nothing is known before the first unit)."""

    def __init__(self, total: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.clock = max(float(total), 1.0), clock
        self.start = clock()

    def eta_s(self, done: float) -> float | None:
        elapsed = self.clock() - self.start
        return None if done <= 0 else elapsed * max(0.0, self.total - done) / done

    def line(self, done: float) -> str:
        """``37% done, 0:04:10 elapsed, ETA 0:07:05``."""
        elapsed = self.clock() - self.start
        return (f"{min(1.0, done / self.total):.0%} done, {duration(elapsed)} elapsed, ETA "
                f"{duration(self.eta_s(done))}")
