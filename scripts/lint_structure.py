"""Structure lint (``nox -s lint``, and ``tests/test_lint_structure.py`` in CI): what ruff does not catch.

- *unreferenced definitions*: a module-level function or class of ``nsa/`` or ``nsa_cli/`` whose name appears
  nowhere else (library, CLI, tests, scripts) and not in a package's public ``__all__``;
- *re-export facades*: a name a module imports only to list it in its ``__all__``, or binds to another name
  (``alias = imported``), so that callers reach it through the wrong module;
- *blank runs*: three or more blank lines in a row, or a blank line right after a line that opens a block.

    uv run python scripts/lint_structure.py        # prints each finding, exits 1 when there is one
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("nsa", "nsa_cli")
REFERENCES = ("nsa", "nsa_cli", "tests", "scripts", "noxfile.py", "docs", "README.md")
# entry points and protocol methods that nothing in the tree calls by name
ENTRY = {"main", "register", "__getattr__", "__dir__"}


def _files(*parts: str) -> list[Path]:
    """The Python files of ``parts`` (and the markdown of a docs folder or file: a documented name is used)."""
    out: list[Path] = []
    for part in parts:
        p = ROOT / part
        out += [p] if p.is_file() else sorted([*p.rglob("*.py"), *p.rglob("*.md")])
    return out


def _py(*parts: str) -> list[Path]:
    return [p for p in _files(*parts) if p.suffix == ".py"]


def _public_api() -> set[str]:
    """Names a package's ``__init__`` exports (``__all__`` or a lazy table): the library's public surface."""
    names: set[str] = set()
    for init in ROOT.glob("nsa/**/__init__.py"):
        names |= set(re.findall(r"[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']", init.read_text()))
    return names


def unreferenced() -> list[str]:
    texts = {p: p.read_text() for p in _files(*REFERENCES)}
    words: dict[str, int] = {}
    for text in texts.values():
        for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text):
            words[w] = words.get(w, 0) + 1
    api = _public_api()
    out = []
    for path in _py(*SOURCES):
        for node in ast.parse(texts[path]).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = node.name
                if name in ENTRY or name in api or name.startswith("__"):
                    continue
                if any(isinstance(d, ast.Call | ast.Attribute | ast.Name) for d in node.decorator_list):
                    continue  # registered by a decorator (typer commands, pytest fixtures)
                if words.get(name, 0) <= 1:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name} is defined but never used")
    return out


def facades() -> list[str]:
    out = []
    for path in _py(*SOURCES):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import)
                    for a in n.names}
        listed: set[str] = set()
        for n in tree.body:
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
                listed = {e.value for e in ast.walk(n.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            elif (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                  and isinstance(n.value, ast.Name) and n.value.id in imported):
                out.append(f"{path.relative_to(ROOT)}:{n.lineno}: {n.targets[0].id} = {n.value.id} re-exports an "
                           "imported name under another")
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
        for name in sorted(listed & imported - used):
            out.append(f"{path.relative_to(ROOT)}: {name} is imported only to be re-exported in __all__")
    return out


def blank_runs() -> list[str]:
    out = []
    for path in _py(*SOURCES):
        lines = path.read_text().splitlines()
        blank = 0
        for i, line in enumerate(lines, 1):
            blank = blank + 1 if not line.strip() else 0
            if blank == 3:
                out.append(f"{path.relative_to(ROOT)}:{i}: three blank lines in a row")
            prev = lines[i - 2] if i > 1 else ""
            if not line.strip() and prev.rstrip().endswith(":") and not prev.lstrip().startswith("#") \
                    and re.match(r"\s*(def|class|if|elif|else|for|while|with|try|except|finally)\b", prev):
                out.append(f"{path.relative_to(ROOT)}:{i}: a blank line right after a block opens")
    return out


def findings() -> list[str]:
    return unreferenced() + facades() + blank_runs()


if __name__ == "__main__":
    found = findings()
    for line in found:
        print(line)
    sys.exit(1 if found else 0)
