"""Developer sessions: ``uv run nox -s tests lint typecheck``."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The CI test command (what README and .ci/run run)."""
    session.run("uv", "run", "pytest", *session.posargs, external=True)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff lint, the layer contracts (tests/test_layers.py), the CLI as a skin
    (tests/test_structure_counts.py: scripts/structure_counts.py against issue 56's targets) and the structure
    lint (scripts/lint_structure.py: unreferenced definitions, re-export facades, blank runs)."""
    session.run("uv", "run", "ruff", "check", "nsa", "nsa_cli", "tests", "noxfile.py", external=True)
    session.run("uv", "run", "pytest", "-q", "tests/test_layers.py", "tests/test_structure_counts.py",
                external=True)
    session.run("uv", "run", "python", "scripts/lint_structure.py", external=True)


@nox.session(venv_backend="none")
def typecheck(session: nox.Session) -> None:
    """mypy over the library and the CLI."""
    session.run("uv", "run", "mypy", external=True)
