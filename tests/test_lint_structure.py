"""The structure lint of ``nox -s lint`` (``scripts/lint_structure.py``) holds in CI too: no unreferenced
definitions, no re-export facades, no blank runs; and it does catch each of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.script_module import script_module

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_is_clean() -> None:
    assert script_module("lint_structure").findings() == []


def test_it_finds_each_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lint = script_module("lint_structure")
    (tmp_path / "nsa").mkdir()
    (tmp_path / "nsa_cli").mkdir()
    (tmp_path / "nsa" / "a.py").write_text(
        "from nsa.b import used, passed_on\nfrom nsa.c import other\n\nalias = other\n__all__ = ['passed_on']\n\n\n\n"
        "def lonely() -> None:\n\n    return used()\n")
    monkeypatch.setattr(lint, "ROOT", tmp_path)
    found = lint.findings()
    assert any("lonely is defined but never used" in f for f in found)
    assert any("alias = other re-exports" in f for f in found)
    assert any("passed_on is imported only to be re-exported" in f for f in found)
    assert any("three blank lines" in f for f in found) and any("right after a block opens" in f for f in found)
