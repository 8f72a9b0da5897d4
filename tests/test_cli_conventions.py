"""CLI conventions (issue 25): one meaning per short flag across every command, ``--json`` prints JSON on stdout
everywhere (``--json-out PATH`` writes a file), run directories typed as paths, commands registered statically
(an import error is an error), help derived from one place, and the old spellings read with one deprecation
line each."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from nsa.config import named_configs
from nsa_cli.app import app
from nsa_cli.compat import Command
from tests.conftest import parse_cli, write_run

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def _commands() -> dict[str, Any]:
    """Every leaf command of the CLI by its path (``"bench attention"``)."""
    out: dict[str, Any] = {}

    def walk(cmd: Any, path: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            out[" ".join(path)] = cmd

    walk(typer.main.get_command(app), [])
    return out


def _options(cmd: Any) -> list[Any]:
    return [p for p in cmd.params if p.param_type_name == "option"]


COMMANDS = _commands()


def test_every_command_is_registered() -> None:
    assert set(COMMANDS) == {
        "preflight", "smoke", "train", "watch", "ack", "halt", "dump", "report", "sample", "eval", "export", "profiles list",
        "profiles show", "bench attention", "bench train", "bench decode", "bench retrieval", "bench quality"}


def test_a_short_flag_means_one_thing_across_the_cli() -> None:
    meaning: dict[str, set[str]] = {}
    for path, cmd in COMMANDS.items():
        for opt in _options(cmd):
            longs = [o for o in opt.opts if o.startswith("--")]
            for short in (o for o in [*opt.opts, *opt.secondary_opts] if len(o) == 2 and o[0] == "-" and o[1] != "-"):
                meaning.setdefault(short, set()).add(longs[0] if longs else short)
                assert longs, f"{path}: {short} has no long spelling"
    clashes = {s: sorted(m) for s, m in meaning.items() if len(m) > 1}
    assert clashes == {}
    assert meaning["-p"] == {"--profile"} and meaning["-o"] == {"--out-dir"} and meaning["-c"] == {"--config"}


def test_json_is_a_switch_everywhere_and_files_take_json_out() -> None:
    with_json = []
    for path, cmd in COMMANDS.items():
        for opt in _options(cmd):
            if "--json" in opt.opts:
                assert opt.is_flag and opt.help.startswith("Print ") and "stdout" in opt.help, path
                with_json.append(path)
            assert not any(o.startswith("--json") and o not in ("--json", "--json-out") for o in opt.opts), path
    assert set(with_json) == set(COMMANDS) - {"train", "sample"}
    json_out = {p for p, c in COMMANDS.items() if any("--json-out" in o.opts for o in _options(c))}
    assert json_out == {"eval", "bench attention", "bench train", "bench decode", "bench retrieval", "bench quality"}


def test_run_directories_are_paths_everywhere() -> None:
    for path in ("watch", "ack", "halt", "dump", "sample", "eval", "report", "export"):
        args = [p for p in COMMANDS[path].params if p.param_type_name == "argument"]
        assert args and all(_is_path(a) for a in args), path
    for path in ("train", "smoke", "preflight"):
        (opt,) = [o for o in _options(COMMANDS[path]) if "--out-dir" in o.opts]
        assert _is_path(opt) and not opt.multiple, path


def _is_path(param: Any) -> bool:
    """A parameter typed ``Path`` (or a list of them): typer 0.29 keeps the annotation, 0.27 a click type."""
    described = getattr(param, "type_descriptor", None)
    if described is not None:
        return described.annotation in (Path, list[Path])
    return type(param.type).__name__ in ("Path", "TyperPath")


def _callbacks(t: typer.Typer) -> list[Any]:
    out = [c.callback for c in t.registered_commands]
    for group in t.registered_groups:
        out += _callbacks(group.typer_instance)
    return out


def test_derived_options_build_on_the_oldest_pinned_typer() -> None:
    """A command whose options come from a library request takes them as ``**fields``; typer 0.27 (the floor
    of the pin, the GPU machines' version) builds a parameter for that var-keyword before the options are
    derived and refuses ``Any`` there ("Type not yet supported"): every command's CLI failed to build on
    it. Such a var-keyword is annotated ``str``, which every pinned typer reads."""
    callbacks = _callbacks(app)
    assert len(callbacks) >= 18
    kw = [(fn.__name__, p.annotation) for fn in callbacks for p in inspect.signature(fn).parameters.values()
          if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert kw and all(a in (str, "str") for _, a in kw), kw


def test_help_names_the_shipped_configs_from_one_place() -> None:
    names = ", ".join(named_configs())
    assert names == "m7c-125m, needle, retrieval, tiny"
    for path in ("train", "preflight", "smoke", "profiles show", "bench train", "bench decode", "bench retrieval"):
        (opt,) = [o for o in _options(COMMANDS[path]) if "--config" in o.opts]
        assert f"({names})" in opt.help, path
    readme = (ROOT / "README.md").read_text()
    assert "a shipped name: " + ", ".join(f"`{n}`" for n in named_configs()) in readme
    from nsa.config import load_run_config
    from nsa.config.resolve import default_config_note

    note = default_config_note(load_run_config(None, environ={}))
    assert note is not None and f"--config {names} or a YAML path" in note


def test_smoke_duration_agrees_between_help_and_readme() -> None:
    from nsa_cli.commands.smoke import CPU_DURATION, EPILOG

    assert CPU_DURATION in EPILOG
    assert f"on a CPU it takes {CPU_DURATION}" in " ".join((ROOT / "README.md").read_text().split())


# --- static registration -------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["nsa_cli.commands.halt", "nsa_cli.commands.bench_decode"])
def test_a_command_module_that_fails_to_import_is_an_error(module: str) -> None:
    """A broken command module stops ``nsa`` with its import error: it is never silently left out."""
    code = f"import sys; sys.modules[{module!r}] = None\nimport nsa_cli.app"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "ModuleNotFoundError" in proc.stderr and module in proc.stderr


def test_help_stays_light() -> None:
    """The statically imported command modules load neither torch nor the config package (pydantic): the
    shipped config names in the help come from the pathlib-only ``nsa.configs``."""
    code = "import sys, nsa_cli.app; print(sorted(m for m in ('torch', 'pydantic', 'nsa.config') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


# --- --json prints JSON on stdout in every command -----------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nsa.train.trainer import Trainer
    from tests.conftest import quiet, resolve

    run = tmp_path_factory.mktemp("conventions") / "run"
    assert Trainer(resolve(run, 2, eval__every=0), reporter=quiet()).fit().status == "completed"
    return run


def _argv(path: str, tmp: Path, trained: Path) -> list[str]:
    run = write_run(tmp / "written", seed=3)
    return {
        "preflight": ["preflight", "--profile", "cpu", "--config", "tiny", "--out-dir", str(tmp), "--json"],
        "smoke": ["smoke", "--steps", "2", "--skip-preflight", "--out-dir", str(tmp / "smoke"), "--json"],
        "watch": ["watch", str(run), "--once", "--json"],
        "halt": ["halt", str(run), "--json"],
        "ack": ["ack", str(run), "--reason", "checked", "--json"],
        "dump": ["dump", str(trained), "--timeout", "0.1", "--json"],  # its trainer is gone: exit 1, said in JSON
        "report": ["report", str(run), "--out", str(tmp / "rep"), "--no-charts", "--json"],
        "profiles list": ["profiles", "list", "--json"],
        "profiles show": ["profiles", "show", "cpu", "--json"],
        "eval": ["eval", str(trained), "--task", "mqar", "--contexts", "32", "--pairs", "2", "--samples", "2",
                 "--no-save", "--json"],
        "export": ["export", str(trained), "--format", "hf", str(tmp / "hf"), "--json"],
        "bench attention": ["bench", "attention", "--tiny", "--seq-lens", "64", "--no-peer", "--json"],
        "bench train": ["bench", "train", "--tiny", "--attention", "nsa", "--json"],
        "bench decode": ["bench", "decode", "--tiny", "--contexts", "64", "--batches", "1", "--mode", "attention",
                         "--no-graphs", "--json"],
        "bench retrieval": ["bench", "retrieval", "--config", "tiny", "--seq-len", "64", "--gap", "20", "--steps", "2",
                            "--eval-every", "2", "--eval-samples", "4", "--variants", "nsa", "--json"],
        "bench quality": ["bench", "quality", "--tiny", "--arms", "nsa", "--steps", "2", "-o", str(tmp / "q"),
                          "--json"],
    }[path]


@pytest.mark.parametrize("path", sorted(set(COMMANDS) - {"train", "sample"}))
def test_json_prints_json_on_stdout(path: str, tmp_path: Path, trained: Path) -> None:
    res = runner.invoke(app, _argv(path, tmp_path, trained), env={"COLUMNS": "200"})
    # 0, but dump: its fixture run has no trainer, a check it reports as failed (exit 1), still JSON
    assert res.exit_code == (1 if path == "dump" else 0), res.output
    json.loads(res.stdout)  # the whole of stdout is one JSON document
    assert "warning:" not in res.stderr or "deprecated" not in res.stderr


def test_json_out_writes_the_file_and_json_prints_too(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    res = runner.invoke(app, ["bench", "attention", "--tiny", "--seq-lens", "64", "--no-peer", "--json-out", str(out)])
    assert res.exit_code == 0 and "NSA vs dense attention" in res.stdout and f"saved {out}" in res.stdout
    both = runner.invoke(app, ["bench", "attention", "--tiny", "--seq-lens", "64", "--no-peer", "--json",
                               "--json-out", str(out)])
    assert both.exit_code == 0 and json.loads(both.stdout) == json.loads(out.read_text())
    assert f"saved {out}" in both.stderr


# --- deprecated spellings: still read, one line each on stderr -----------------------------------------


def _parsed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    """The parameters ``argv`` parses to (nothing runs; a path as a ``Path``: typer 0.27 converts it only when
    the command runs) and what the parse printed on stderr."""
    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("nsa", list(argv))
    while hasattr(cmd, "resolve_command"):
        args = [*getattr(ctx, "_protected_args", []), *ctx.args]
        name, cmd, rest = cmd.resolve_command(ctx, args)
        ctx = cmd.make_context(name, rest, parent=ctx)
    paths = {p.name for p in cmd.params if _is_path(p)}
    params = {k: v if k not in paths or v is None or isinstance(v, Path) else Path(v) if isinstance(v, str)
              else [Path(x) for x in v] for k, v in ctx.params.items()}
    return params, capsys.readouterr().err


def test_old_json_path_spelling_is_read_with_a_deprecation_line(capsys: pytest.CaptureFixture[str]) -> None:
    params, err = _parsed(["bench", "attention", "--tiny", "--json", "out.json"], capsys)
    assert params["json_out"] == Path("out.json") and params["as_json"] is False
    assert err.strip().splitlines() == [
        "warning: --json PATH is deprecated (read until 2027-03-01): use --json-out PATH; "
        "--json alone prints the JSON to stdout"]
    params, err = _parsed(["bench", "train", "--json=t.json", "--tiny"], capsys)
    assert params["json_out"] == Path("t.json") and "deprecated" in err
    # eval: a value after --json is the old spelling only where the run directory is already given
    params, err = _parsed(["eval", "RUN", "--task", "loss", "--json", "loss.json"], capsys)
    assert (params["path"], params["json_out"], params["as_json"]) == (Path("RUN"), Path("loss.json"), False)
    assert len(err.strip().splitlines()) == 1
    params, err = _parsed(["eval", "RUN", "--task", "loss", "--json", "-"], capsys)
    assert params["as_json"] is True and params["json_out"] is None and "use --json" in err
    params, err = _parsed(["eval", "--json", "RUN", "--task", "loss"], capsys)  # today's switch, then the run
    assert (params["path"], params["as_json"], params["json_out"]) == (Path("RUN"), True, None) and err == ""


def test_old_short_flags_are_read_with_a_deprecation_line(capsys: pytest.CaptureFixture[str]) -> None:
    params, err = _parsed(["sample", "RUN", "-p", "Once upon"], capsys)
    assert params["prompt"] == "Once upon"
    assert err.strip() == ("warning: -p is deprecated (read until 2027-03-01): use --prompt; "
                           "-p means --profile in every command")
    params, err = _parsed(["report", "RUN", "-o", "out.md"], capsys)
    assert params["out"] == Path("out.md") and "use --out; -o means --out-dir in every command" in err
    params, err = _parsed(["sample", "RUN", "--prompt", "-p"], capsys)  # today's spelling: the prompt is "-p"
    assert params["prompt"] == "-p" and err == ""
    params, err = _parsed(["sample", "RUN", "-p", "-o"], capsys)  # the old flag's value is kept as given too
    assert params["prompt"] == "-o" and err.count("deprecated") == 1
    params, err = _parsed(["report", "RUN", "--", "-o"], capsys)  # after --: positional, as given
    assert params["run_dirs"] == [Path("RUN"), Path("-o")] and err == ""


def test_upgrade_leaves_todays_spellings_alone() -> None:
    cmd = COMMANDS["eval"]
    assert isinstance(cmd, Command)
    argv = ["RUN", "--task", "needle", "--json", "--json-out", "x.json", "--contexts", "64"]
    assert cmd.upgrade(list(argv)) == (argv, [])


def test_a_deprecated_spelling_runs_end_to_end(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", seed=5)
    out = tmp_path / "r.md"
    res = runner.invoke(app, ["report", str(run), "-o", str(out), "--no-charts", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["path"] == str(out) and out.is_file()
    assert [ln for ln in res.stderr.splitlines() if "deprecated" in ln] == [
        "warning: -o is deprecated (read until 2027-03-01): use --out; -o means --out-dir in every command"]


def test_the_docs_use_todays_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_runbooks import ALL

    for book, line, _, argv, _ in ALL:
        parse_cli(argv)
        err = capsys.readouterr().err
        assert "deprecated" not in err, f"{book}:{line}: nsa {' '.join(argv)}: {err}"
