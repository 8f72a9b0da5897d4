"""Check results: PASS / WARN / FAIL with a one-line reason and a fix hint."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass
class Check:
    """One check: its status, a one-line reason, a fix hint, and facts for the report."""

    name: str
    status: Status
    reason: str
    hint: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.value
        return out


def passed(name: str, reason: str, **details: Any) -> Check:
    return Check(name, Status.PASS, reason, details=details)


def warned(name: str, reason: str, hint: str = "", **details: Any) -> Check:
    return Check(name, Status.WARN, reason, hint, details=details)


def failed(name: str, reason: str, hint: str = "", **details: Any) -> Check:
    return Check(name, Status.FAIL, reason, hint, details=details)


@dataclass
class CheckReport:
    """An ordered list of checks plus facts shared by the report (git snapshot, versions)."""

    kind: str
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.status is not Status.FAIL for c in self.checks)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in Status}
        for c in self.checks:
            out[c.status.value] += 1
        return out

    def get(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    def run(self, name: str, fn: Callable[[], Check | list[Check]]) -> None:
        """Run one check function; an unexpected exception becomes a FAIL naming it (never a crash)."""
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:
            result = failed(name, f"check crashed: {type(exc).__name__}: {exc}".splitlines()[0],
                            "run with --debug and report this")
        for c in result if isinstance(result, list) else [result]:
            c.seconds = round(time.perf_counter() - t0, 3)
            self.checks.append(c)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ok": self.ok,
            "counts": self.counts(),
            "checks": [c.to_dict() for c in self.checks],
            "facts": self.facts,
        }
