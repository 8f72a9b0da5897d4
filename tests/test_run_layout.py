"""``nsa.rundir.layout.parse_halt``: the one reader of the ``.HALT`` format (trainer, watch, report)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nsa.rundir.layout import HALT_FILE, parse_halt
from nsa.runs.reader import halt_record
from nsa.train.rundir import halt_request


@pytest.mark.parametrize(
    ("text", "record", "partial"),
    [
        ('{"reason": "watchdog: stale", "rule": "stale"}', {"reason": "watchdog: stale", "rule": "stale"}, False),
        ("please stop\n", {"reason": "please stop"}, False),
        ("", {"reason": ""}, True),
        ('{"reason": "cut sh', {"reason": '{"reason": "cut sh'}, True),
        ("[1, 2]", {"reason": "[1, 2]"}, False),  # JSON but not an object: its text is the reason
    ],
)
def test_parse_halt(text: str, record: dict[str, str], partial: bool) -> None:
    assert parse_halt(text) == (record, partial)


def test_trainer_and_reader_agree_on_a_halt_file(tmp_path: Path) -> None:
    (tmp_path / HALT_FILE).write_text('{"reason": "operator: maintenance", "who": "ops"}')
    assert halt_request(tmp_path, settle_s=0)[0] == "operator: maintenance"
    rec = halt_record(tmp_path)
    assert rec is not None and rec["reason"] == "operator: maintenance" and rec["who"] == "ops" and rec["time"] > 0
    (tmp_path / HALT_FILE).write_text("")
    assert halt_request(tmp_path, settle_s=0)[0] == "halt file"
    rec = halt_record(tmp_path)
    assert rec is not None and rec["reason"] == "(empty .HALT)"
