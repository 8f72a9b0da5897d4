"""Compatibility with an end (issue 34): this toolkit's own pre-release spellings are read until one date,
and this test fails once it has passed, so they are removed (the older system's inputs stay)."""

from __future__ import annotations

import datetime

from nsa.config.legacy import MOVED_KEYS
from nsa.deprecation import PRE_RELEASE_UNTIL, READ_UNTIL
from nsa_cli.compat import deprecation


def test_the_pre_release_spellings_are_gone_by_their_date() -> None:
    assert datetime.date.today() < PRE_RELEASE_UNTIL, (
        f"{PRE_RELEASE_UNTIL} has passed: remove nsa_cli/compat.py (--json PATH, the short-flag rewrites), "
        "nsa.config.legacy.MOVED_KEYS and their docs (docs/migrating.md), then this test")


def test_every_deprecation_line_names_the_date() -> None:
    assert f"read until {PRE_RELEASE_UNTIL.isoformat()}" == READ_UNTIL
    assert READ_UNTIL in deprecation("-p", "--prompt")
    assert MOVED_KEYS  # still read today
