"""``scripts/window_designs.py`` (issue 53's window as two library triangles, timed on a GPU): its split is the
banded window exactly, output and every gradient, checked here with the plain-torch stand-in of the library."""

from __future__ import annotations

import pytest

from tests.script_module import script_module


@pytest.mark.parametrize("S,w", [(48, 8), (64, 16)])
def test_two_triangles_are_the_window(S: int, w: int) -> None:
    """Float64, seed 0, two batch rows (the chunk before never crosses into the previous row), GQA 6/2."""
    script_module("window_designs").check(S=S, w=w)
