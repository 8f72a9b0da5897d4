"""Structure counts of a source tree (issue 34): record field names spelled as strings outside ``nsa/rundir``,
places each watch rule is spelled, the longest CLI functions, and which library parts the CLI imports; and the
CLI as a skin (issue 56): its lines, its longest command function, its commands that write through the one output
sink (``nsa_cli.render.Output``; nothing printed outside ``nsa_cli/render``), and the scripts that redo library
work (read the profiler's kernel times themselves, or patch the library at run time). ``tests/test_structure_counts.py``
holds the issue's targets (:data:`TARGETS`).

    uv run python scripts/structure_counts.py [TREE ...]      # default: this checkout

Field names are the record vocabulary (heartbeat events, CSV headers, metrics.json, env.json, anomaly
records, alarms.jsonl, .HALT) listed below, so two trees are counted against the same set.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections import Counter
from pathlib import Path

# the record fields whose spelling should live in nsa/rundir (the union over the record kinds; names that
# are ordinary words elsewhere, such as "step", "time" or "path", are left out: they would count noise)
FIELDS = {
    "run_name", "world_size", "local_rank", "resumed_from", "steps_total", "source_used", "first_batch_s",
    "loss", "grad_norm", "tokens_per_s", "step_time_s", "fetch_p50_ms", "fetch_p95_ms", "tokens_seen",
    "elapsed_s", "eta_s", "mem_allocated_mib", "mem_reserved_mib", "mem_peak_mib", "rss_mib",
    "gate_entropy_mean", "gate_branch_shares", "gate_collapse_fraction", "sel_keys_mean", "fallback", "mfu",
    "data_skipped", "data_warnings", "answer_loss", "answer_acc", "gpu_mem_errors", "scorer_kl",
    "gpu_util_pct", "gpu_mem_used_mib", "val_loss", "val_ppl", "selection", "sel_recall_mean",
    "sel_recall_min", "cmp_entropy_mean", "fetch_ms", "steps_done", "final_loss", "last_val_loss",
    "best_val_loss", "nsa_settings", "nsa_unknown_variables", "config_path", "device_name", "last_good_checkpoint",
    "fault_injected", "evidence", "session", "heartbeat_age_s",
}
RULES = ("crashed", "stale", "nonfinite", "gate-entropy", "gate-collapse", "grad-spike", "loss-plateau",
         "memory-creep", "throughput-drop", "fetch-stall", "data-fallback", "fallback-rise", "gpu-errors")


def py_files(tree: Path, *parts: str) -> list[Path]:
    return sorted(p for part in parts for p in (tree / part).rglob("*.py"))


def field_strings(tree: Path) -> tuple[int, int, int]:
    """(string constants naming a field, distinct fields, files) in nsa/ and nsa_cli/ outside nsa/rundir."""
    hits: Counter[str] = Counter()
    files = set()
    for p in py_files(tree, "nsa", "nsa_cli"):
        if "rundir" in p.relative_to(tree).parts[:2] and p.parts[-2] == "rundir":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in FIELDS:
                hits[node.value] += 1
                files.add(p)
    return sum(hits.values()), len(hits), len(files)


def rule_places(tree: Path) -> dict[str, int]:
    """Per rule: the lines of nsa/ and nsa_cli/ (code and docstrings) that spell it."""
    out = {}
    texts = [p.read_text().splitlines() for p in py_files(tree, "nsa", "nsa_cli")]
    for rule in RULES:
        pat = re.compile(rf"(?<![\w-]){re.escape(rule)}(?![\w-])")
        out[rule] = sum(1 for lines in texts for line in lines if pat.search(line))
    return out


def function_lengths(tree: Path) -> list[tuple[int, str]]:
    """(lines, file:function) of every function of nsa/ and nsa_cli/, longest first."""
    out = []
    for p in py_files(tree, "nsa", "nsa_cli"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                out.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(tree)}:{node.name}"))
    return sorted(out, reverse=True)


def cli_imports(tree: Path) -> dict[str, int]:
    """Library parts (``nsa.<part>``) the CLI imports, with how many import statements name each."""
    parts: Counter[str] = Counter()
    for p in py_files(tree, "nsa_cli"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                bits = n.split(".")
                if bits[0] == "nsa" and len(bits) > 1:
                    parts[bits[1]] += 1
    return dict(sorted(parts.items()))


# issue 56's targets: what tests/test_structure_counts.py holds
TARGETS = {"cli_lines": 1800, "longest_command_function": 50, "cli_library_parts": 8, "scripts_redoing_library": 0}


def _prints(node: ast.Call) -> bool:
    """``print()``, ``typer.echo()``/``click.echo()``, ``Console(...)``, ``sys.stdout/stderr.write()``."""
    f = node.func
    if isinstance(f, ast.Name):
        return f.id in ("print", "Console")
    if isinstance(f, ast.Attribute):
        base = ast.unparse(f.value)
        return (f.attr == "echo" and base in ("typer", "click")) or f.attr == "Console" or (
            f.attr == "write" and base in ("sys.stdout", "sys.stderr"))
    return False


def cli_lines(tree: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in py_files(tree, "nsa_cli"))


def _registered(tree: Path) -> dict[str, ast.FunctionDef]:
    """The functions registered as commands (``@app.command("x")`` or ``app.command("x", ...)(fn)``) by
    ``module:name``."""
    out: dict[str, ast.FunctionDef] = {}
    for p in py_files(tree, "nsa_cli/commands"):
        mod = ast.parse(p.read_text())
        defs = {n.name: n for n in ast.walk(mod) if isinstance(n, ast.FunctionDef)}
        for node in ast.walk(mod):
            if isinstance(node, ast.FunctionDef):
                for d in node.decorator_list:
                    if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command" and d.args:
                        out[f"{p.stem}:{ast.literal_eval(d.args[0])}"] = node
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Call)
                  and getattr(node.func.func, "attr", "") == "command" and node.func.args and node.args
                  and isinstance(node.args[0], ast.Name) and node.args[0].id in defs):
                out[f"{p.stem}:{ast.literal_eval(node.func.args[0])}"] = defs[node.args[0].id]
    return out


def output_sink(tree: Path) -> dict[str, object]:
    """Commands whose function writes through ``Output``, and the printing calls outside ``nsa_cli/render``."""
    commands = _registered(tree)
    through = sorted(name for name, fn in commands.items()
                     if any(isinstance(n, ast.Name) and n.id == "Output" for n in ast.walk(fn)))
    prints = []
    for p in py_files(tree, "nsa_cli"):
        if "render" in p.relative_to(tree).parts:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and _prints(node):
                prints.append(f"{p.relative_to(tree)}:{node.lineno}")
    return {"commands": len(commands), "through_output": len(through) if not prints else 0,
            "not_through": sorted(set(commands) - set(through)), "prints_outside_render": prints}


def scripts_redoing_library(tree: Path) -> list[str]:
    """Scripts that read the profiler's kernel times themselves (the library's: ``nsa.bench.profile``) or assign
    to an attribute of something they imported from ``nsa`` (a run-time patch of the library)."""
    out = []
    for p in sorted([*(tree / "scripts").glob("*.py"), *(tree / "scripts").glob("*.sh")]):
        if p.name == Path(__file__).name:
            continue
        text = p.read_text()
        if re.search(r"torch\.profiler|key_averages|\.events\(\)", text):
            out.append(f"{p.name}: reads the profiler")
        if p.suffix != ".py":
            continue
        mod = ast.parse(text)
        names = {a.asname or a.name.split(".")[0] for n in ast.walk(mod) if isinstance(n, ast.ImportFrom | ast.Import)
                 and (getattr(n, "module", None) or getattr(n.names[0], "name", "")).startswith("nsa")
                 for a in n.names}
        for n in ast.walk(mod):
            targets = n.targets if isinstance(n, ast.Assign) else []
            for t in targets:
                root = t
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(t, ast.Attribute) and isinstance(root, ast.Name) and root.id in names:
                    out.append(f"{p.name}:{n.lineno}: patches {ast.unparse(t)}")
    return out


def skin(tree: Path) -> dict[str, object]:
    """Issue 56's counts of the CLI as a skin."""
    commands = [(n, f) for n, f in function_lengths(tree) if f.startswith("nsa_cli/commands/")]
    return {"cli_lines": cli_lines(tree), "longest_command_function": commands[0][0] if commands else 0,
            "longest_command": commands[0][1] if commands else None,
            "cli_library_parts": len(cli_imports(tree)), "output_sink": output_sink(tree),
            "scripts_redoing_library": scripts_redoing_library(tree)}


def counts(tree: Path) -> dict[str, object]:
    n, distinct, files = field_strings(tree)
    places = rule_places(tree)
    lengths = function_lengths(tree)
    long = [(n_, f) for n_, f in lengths if n_ > 100]
    imports = cli_imports(tree)
    return {
        "field_name_strings_outside_rundir": {"strings": n, "distinct_fields": distinct, "files": files},
        "rule_spellings": {"total_lines": sum(places.values()), "max_per_rule": max(places.values()),
                           "per_rule": places},
        "functions_over_100_lines": {"total": len(long), "cli": sum(f.startswith("nsa_cli") for _, f in long),
                                     "which": [f"{f} ({n_})" for n_, f in long]},
        "longest_cli_functions": [f"{f} ({n_})" for n_, f in lengths if f.startswith("nsa_cli")][:6],
        "cli_imports_by_library_part": {"parts": len(imports), "imports": imports},
        "cli_skin": skin(tree),
    }


if __name__ == "__main__":
    trees = [Path(a) for a in sys.argv[1:]] or [Path(__file__).resolve().parents[1]]
    print(json.dumps({str(t): counts(t) for t in trees}, indent=1))
