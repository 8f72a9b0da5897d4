"""Layer contracts of the code base (docs/design.md, "Layers"), checked on every import statement,
module-level or inside a function, of every module under ``nsa/`` and ``nsa_cli/``:

- ``nsa.ops`` (kernels and their references) knows nothing of config, model, training, runs or the CLI;
- ``nsa.config`` imports nothing of ``nsa`` above it (only ``nsa.errors``, ``nsa.fileio``, ``nsa.params`` and the
  list of shipped configs, ``nsa.configs``);
- ``nsa.model`` knows nothing of training, checks, benchmarks, evaluation or the CLI;
- the library (``nsa``) never imports the CLI (``nsa_cli``) nor Rich: it returns results and emits
  structured events (``nsa.train.events``), the CLI renders them;
- reading a run (``nsa.runs``) needs no torch and nothing of training, model or ops (also checked by
  importing every run module in a fresh interpreter).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute module names imported by ``path`` (relative imports resolved), with their line."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]  # `from nsa import ops`
    return out


def _under(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


# (layer, what it may not import, what it may import despite that)
CONTRACTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("nsa.ops", ("nsa.config", "nsa.model", "nsa.train", "nsa.runs", "nsa.data", "nsa.eval", "nsa.checks",
                 "nsa.bench", "nsa_cli"), ()),
    ("nsa.config", ("nsa", "nsa_cli"), ("nsa.config", "nsa.configs", "nsa.errors", "nsa.fileio", "nsa.params")),
    ("nsa.model", ("nsa.train", "nsa.checks", "nsa.bench", "nsa.eval", "nsa_cli"), ()),
    ("nsa", ("nsa_cli", "rich"), ()),
    ("nsa.runs", ("torch", "triton", "nsa.train", "nsa.model", "nsa.ops", "nsa_cli"), ()),
)


def _violations(layer: str, banned: tuple[str, ...], allowed: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((ROOT / "nsa").rglob("*.py")):
        name = _module_name(path)
        if not _under(name, (layer,)):
            continue
        for mod, line in _imports(path):
            if _under(mod, banned) and not _under(mod, allowed) and mod != "nsa":
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return sorted(set(bad))


@pytest.mark.parametrize(("layer", "banned", "allowed"), CONTRACTS, ids=[c[0] for c in CONTRACTS])
def test_layer_contract(layer: str, banned: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    assert _violations(layer, banned, allowed) == []


def test_the_contract_check_can_fail(tmp_path: Path) -> None:
    """The scanner sees lazy imports inside functions, relative imports and ``from nsa import ops``."""
    code = "def f():\n    from nsa.train import trainer\nfrom .. import model\nfrom nsa import ops\n"
    path = ROOT / "nsa" / "ops" / "_layer_probe.py"
    path.write_text(code)
    try:
        found = {m for m, _ in _imports(path)}
        assert {"nsa.train", "nsa.model", "nsa.ops"} <= found
        assert any("_layer_probe.py" in v for v in _violations("nsa.ops", CONTRACTS[0][1], ()))
    finally:
        path.unlink()


def test_reading_a_run_imports_no_torch() -> None:
    mods = sorted(_module_name(p) for p in (ROOT / "nsa" / "runs").glob("*.py"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + "bad = sorted(m for m in ('torch', 'triton', 'nsa.train', 'nsa.model', 'nsa.ops') if m in sys.modules)\n"
            + "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
