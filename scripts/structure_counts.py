"""Structure counts of a source tree (issue 34): record field names spelled as strings outside ``nsa/rundir``,
places each watch rule is spelled, the longest CLI functions, and which library parts the CLI imports.

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
    }


if __name__ == "__main__":
    trees = [Path(a) for a in sys.argv[1:]] or [Path(__file__).resolve().parents[1]]
    print(json.dumps({str(t): counts(t) for t in trees}, indent=1))
