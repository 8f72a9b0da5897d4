"""Preflight and smoke checks: library functions returning result objects (the CLI renders them):
``nsa.checks.preflight.run_preflight``, ``nsa.checks.smoke.run_smoke``."""

from nsa.checks.result import Check, CheckReport, Status

__all__ = ["Check", "CheckReport", "Status"]
