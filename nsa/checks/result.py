"""Check results: PASS / WARN / FAIL with a one-line reason and a fix hint."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from nsa.view import Block, Column, Line, Result, Table


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
class CheckReport(Result):
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

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def title(self) -> str:
        f = self.facts
        if self.kind == "smoke":
            return (f"nsa smoke (profile {f.get('profile')}, config {f.get('config')}, {f.get('steps')} "
                    f"steps, run {f.get('run_dir')})")
        return f"nsa {self.kind} (profile {f.get('profile') or 'none'}, device {f.get('device')})"

    def view(self) -> list[Block]:
        """The checks as a table (status, check, reason, hint), then the verdict and the counts."""
        table = Table(self.title(),
                      [Column("status", "left", no_wrap=True), Column("check", "left", no_wrap=True),
                                     Column("reason", "left"), Column("hint", "left", "dim")],
                      title_left=True)
        for c in self.checks:
            table.add((c.status.value, c.status.value), c.name, c.reason, c.hint)
        n = self.counts()
        verdict = "FAIL" if n["FAIL"] else "PASS"
        line = f"{verdict}: {n['PASS']} passed, {n['WARN']} warning(s), {n['FAIL']} failed"
        return [table, Line(line, verdict, lead=len(verdict))]
