"""The runbooks cannot rot: every ``nsa ...`` command in runbooks/*.md must parse against the real CLI,
and the ones a CPU can run (profiles, preflight, watch, halt, report, tiny training and benches) run.

Commands come from fenced code blocks (``VAR=value nsa ...`` prefixes and ``\\`` continuations
handled) and from inline code spans in the prose (parsed only). Run-directory arguments of watch, halt
and report that do not exist yet are created as finished hand-written runs in a scratch folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nsa_cli.app import app
from tests.conftest import parse_cli, split_command, write_run

ROOT = Path(__file__).resolve().parent.parent
RUNBOOKS = sorted((ROOT / "runbooks").glob("*.md"))
RUN_FOR_REAL = {"profiles", "preflight", "watch", "halt", "report"}
TINY_STEPS = "3"



def extract(path: Path) -> list[tuple[int, dict[str, str], list[str], bool]]:
    """``(line, env, argv, fenced)`` for every nsa command of a runbook."""
    out: list[tuple[int, dict[str, str], list[str], bool]] = []
    lines = path.read_text().splitlines()
    fenced = False
    pending = ""
    start = 0
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            if not pending:
                start = i
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text, pending = pending + line, ""
            env, tokens = split_command(text)
            if tokens[:3] == ["uv", "run", "nsa"]:
                tokens = tokens[2:]
            if tokens and tokens[0] == "nsa":
                out.append((start, env, tokens[1:], True))
        else:
            for span in re.findall(r"`(nsa [^`]*)`", line):
                out.append((i, {}, split_command(span)[1][1:], False))
    return out


ALL = [(p.name, n, env, argv, fenced) for p in RUNBOOKS for n, env, argv, fenced in extract(p)]
# the README and docs: commands in code blocks must parse too (their prose shows syntax like [--json])
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ALL += [(str(p.relative_to(ROOT)), n, env, argv, fenced) for p in DOCS for n, env, argv, fenced in extract(p) if fenced]


def test_runbooks_exist_and_have_commands() -> None:
    names = {p.name for p in RUNBOOKS}
    assert {"single-gpu-production-50k.md", "selection-performance-matrix.md", "two-gpu-torchrun-probe.md",
            "monitoring-and-troubleshooting.md"} <= names
    for p in RUNBOOKS:
        if p.name != "README.md":
            assert any(f for _, _, _, f in extract(p)), f"{p.name} has no nsa command"


@pytest.mark.parametrize(("book", "line", "env", "argv", "fenced"), ALL,
                         ids=[f"{b}:{n}" for b, n, _, _, _ in ALL])
def test_command_parses(book: str, line: int, env: dict[str, str], argv: list[str], fenced: bool) -> None:
    try:
        path = parse_cli(argv)
    except Exception as exc:  # typer's vendored click UsageError and subclasses
        if not hasattr(exc, "format_message"):
            raise
        pytest.fail(f"{book}:{line}: `nsa {' '.join(argv)}` does not parse: {exc.format_message()}")
    assert path, argv
    for k in env:
        if k.startswith("NSA_"):
            from nsa.config.settings import KNOWN

            assert k in KNOWN, f"{book}:{line}: unknown setting {k}"


def _cpu_feasible(argv: list[str]) -> bool:
    sub = argv[0]
    if sub in RUN_FOR_REAL:
        return True
    if sub == "train":
        return "tiny" in argv and "--nproc-per-node" not in argv
    if sub == "bench":
        return "--tiny" in argv
    return False


def _prepare(argv: list[str], scratch: Path) -> list[str]:
    """Finished fixture runs for run-directory arguments that do not exist; tiny step counts."""
    if argv[0] in ("watch", "halt", "report"):
        for tok in argv[1:]:
            if tok.startswith("artifacts/") and not (scratch / tok).exists():
                write_run(scratch / tok, steps=20, steps_total=20)
        if argv[0] == "report" and not any(t.startswith("artifacts/") for t in argv[1:]) \
                and not (scratch / "artifacts").exists():
            write_run(scratch / "artifacts" / "newest", steps=20, steps_total=20)
    if argv[0] == "train":
        argv = [*argv, "--steps", TINY_STEPS, "--set", "eval.every=0", "--set", "checkpoint.every=0"]
    return argv


def _names_gpu_profile(argv: list[str], env: dict[str, str]) -> bool:
    """The command checks this machine against a GPU hardware profile (``--profile``/``--gpu-profile`` or
    ``NSA_PROFILE`` naming one that is not ``cpu``), which a CPU fails with exit 1."""
    names = [argv[i + 1] for i, tok in enumerate(argv[:-1]) if tok in ("--profile", "--gpu-profile", "-p")]
    names += [v for k, v in env.items() if k == "NSA_PROFILE" and v]
    return any(n != "cpu" for n in names)


@pytest.mark.slow
@pytest.mark.parametrize("book", [p.name for p in RUNBOOKS if p.name != "README.md"])
def test_cpu_feasible_commands_run(book: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run them in order (a tiny train creates what the following watch/report read)."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for line, env, argv, fenced in extract(ROOT / "runbooks" / book):
        if not fenced or not _cpu_feasible(argv):
            continue
        real = _prepare(argv, tmp_path)
        res = runner.invoke(app, real, env={**env, "NSA_DEVICE": None, "NSA_PROFILE": None})
        # 0 ok; 1 only where a check of a GPU profile fails on this CPU; 2 would be a usage error
        want = (0, 1) if _names_gpu_profile(real, env) else (0,)
        assert res.exit_code in want, f"{book}:{line}: nsa {' '.join(real)} -> {res.exit_code}\n{res.output[-2000:]}"
        assert "Traceback" not in res.output


def test_checker_catches_rotten_commands() -> None:
    assert split_command('NSA_PREFETCH_DEPTH=16 nsa watch artifacts/x --once > snap.txt  # log it') == (
        {"NSA_PREFETCH_DEPTH": "16"}, ["nsa", "watch", "artifacts/x", "--once"])
    assert parse_cli(["profiles", "show", "cpu"]) == ["profiles", "show"]
    for bad in (["preflight", "--gpu-profile", "x"], ["watch"], ["trian"], ["profiles", "shw", "cpu"],
                ["halt", "run", "--wait", "--timeout", "soon"]):
        with pytest.raises(Exception) as info:
            parse_cli(bad)
        assert hasattr(info.value, "format_message"), bad
