"""The structure lint of ``nox -s lint`` (``scripts/lint_structure.py``) holds in CI too: no unreferenced
definitions, no re-export facades, no blank runs; and it does catch each of them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lint_structure", ROOT / "scripts" / "lint_structure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lint_structure"] = module
    spec.loader.exec_module(module)
    return module


def test_the_tree_is_clean() -> None:
    assert _lint().findings() == []


def test_it_finds_each_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lint = _lint()
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
