"""Layer contracts of the code base (docs/design.md, "Layers"), checked on every import statement,
module-level or inside a function, of every module under ``nsa/`` and ``nsa_cli/``:

- ``nsa.ops`` (kernels and their references) knows nothing of config, model, training, runs or the CLI;
- ``nsa.config`` imports nothing of ``nsa`` above it (only ``nsa.errors``, ``nsa.fileio``, ``nsa.params``, the
  result and view types ``nsa.view`` and the list of shipped configs, ``nsa.configs``);
- ``nsa.model`` knows nothing of training, checks, benchmarks, evaluation or the CLI;
- the library (``nsa``) never imports the CLI (``nsa_cli``) nor Rich: it returns results and emits
  structured events (``nsa.train.events``), the CLI renders them;
- the run-directory format (``nsa.rundir``) sits below model, training and the run readers: no torch,
  nothing of ``nsa`` but ``nsa.errors`` and ``nsa.fileio``;
- reading a run (``nsa.runs``, the monitoring app) needs no torch and nothing of training, model or ops
  (also checked by importing every run and run-dir module in a fresh interpreter);
- the model never reaches the run readers (``nsa.runs``), evaluation never reaches the benchmarks, and
  the Triton kernels (``nsa.ops._triton``) are imported only inside ``nsa.ops``.

Imports are read from ``import``/``from`` statements anywhere in a module, from ``importlib`` and
``__import__`` calls, and from any string constant that is exactly a module path (``"nsa.ops.reference"``
in a loader's table); a bare ``import nsa`` outside ``nsa/__init__.py`` is refused (its lazy exports reach
every layer).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULE_PATH = re.compile(r"^nsa(_cli)?(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def _is_module(text: str) -> bool:
    """``text`` is exactly the dotted path of a module of this repository (not a config key like "nsa.w")."""
    if not MODULE_PATH.match(text):
        return False
    rel = Path(*text.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute module names imported by ``path`` (relative imports resolved), with their line."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name if a.name != "nsa" else "nsa.__init__", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]  # `from nsa import ops`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_module(node.value):
            out.append((node.value, node.lineno))  # importlib.import_module("nsa.x"), a loader's table
    return out


def _under(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


# (layer, what it may not import, what it may import despite that)
_ALL_ABOVE_OPS = ("nsa.config", "nsa.model", "nsa.train", "nsa.runs", "nsa.rundir", "nsa.data", "nsa.eval",
                  "nsa.checks", "nsa.bench", "nsa.hf", "nsa_cli", "nsa.__init__")
CONTRACTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("nsa.ops", _ALL_ABOVE_OPS, ()),
    ("nsa.config", ("nsa", "nsa_cli"),
     ("nsa.config", "nsa.configs", "nsa.deprecation", "nsa.errors", "nsa.fileio", "nsa.params", "nsa.view")),
    ("nsa.model", ("nsa.train", "nsa.checks", "nsa.bench", "nsa.eval", "nsa.runs", "nsa.hf", "nsa_cli", "nsa.__init__"),
     ()),
    # the Hugging Face format sits above the model (it reads weights) and below the trainer and the CLI
    ("nsa.hf", ("nsa.train", "nsa.checks", "nsa.bench", "nsa.eval", "nsa.runs", "nsa_cli", "nsa.__init__"), ()),
    ("nsa", ("nsa_cli", "rich"), ()),
    ("nsa.rundir", ("torch", "triton", "nsa", "nsa_cli"), ("nsa.rundir", "nsa.errors", "nsa.fileio")),
    ("nsa.runs", ("torch", "triton", "nsa.train", "nsa.model", "nsa.ops", "nsa_cli", "nsa.__init__"), ()),
    ("nsa.eval", ("nsa.bench", "nsa_cli", "nsa.__init__"), ()),
    ("nsa.train", ("nsa.runs", "nsa.checks", "nsa.bench", "nsa.eval", "nsa_cli", "nsa.__init__"), ()),
)
# the Triton kernels are the ops layer's own
PRIVATE = (("nsa.ops._triton", "nsa.ops"),)


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


@pytest.mark.parametrize(("private", "owner"), PRIVATE)
def test_private_modules_stay_with_their_owner(private: str, owner: str) -> None:
    bad = []
    for path in sorted((ROOT / "nsa").rglob("*.py")) + sorted((ROOT / "nsa_cli").rglob("*.py")):
        if _under(_module_name(path), (owner,)):
            continue
        bad += [f"{path.relative_to(ROOT)}:{line} imports {mod}" for mod, line in _imports(path) if _under(mod, (private,))]
    assert bad == []


def test_the_contract_check_can_fail(tmp_path: Path) -> None:
    """The scanner sees lazy imports inside functions, relative imports, ``from nsa import ops``, a bare
    ``import nsa`` and a module path handed to importlib."""
    code = ("import importlib\nimport nsa\ndef f():\n    from nsa.train import trainer\nfrom .. import model\n"
            "from nsa import ops\nimportlib.import_module('nsa.train.trainer')\n")
    path = ROOT / "nsa" / "ops" / "_layer_probe.py"
    path.write_text(code)
    try:
        found = {m for m, _ in _imports(path)}
        assert {"nsa.train", "nsa.model", "nsa.ops", "nsa.__init__", "nsa.train.trainer"} <= found
        bad = [v for v in _violations("nsa.ops", CONTRACTS[0][1], ()) if "_layer_probe.py" in v]
        assert any(v.endswith("imports nsa.train.trainer") and ":7 " in v for v in bad), bad
        assert any(v.endswith("imports nsa.__init__") for v in bad), bad
    finally:
        path.unlink()


def test_reading_a_run_imports_no_torch() -> None:
    mods = sorted(_module_name(p) for folder in ("runs", "rundir") for p in (ROOT / "nsa" / folder).glob("*.py"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + "bad = sorted(m for m in ('torch', 'triton', 'nsa.train', 'nsa.model', 'nsa.ops') if m in sys.modules)\n"
            + "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
