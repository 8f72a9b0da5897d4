"""Preflight and smoke checks: library functions returning result objects (the CLI renders them)."""

from nsa.checks.result import Check, CheckReport, Status

__all__ = ["Check", "CheckReport", "Status", "run_preflight", "run_smoke"]


def __getattr__(name: str):
    if name == "run_preflight":
        from nsa.checks.preflight import run_preflight

        return run_preflight
    if name == "run_smoke":
        from nsa.checks.smoke import run_smoke

        return run_smoke
    raise AttributeError(name)
