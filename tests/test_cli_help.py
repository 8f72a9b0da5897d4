"""Every operator command has --help with examples; the CLI starts without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from nsa_cli.app import app

runner = CliRunner()


@pytest.mark.parametrize("cmd", [["preflight"], ["smoke"], ["watch"], ["halt"], ["dump"], ["report"], ["export"],
                                 ["profiles"], ["profiles", "show"], ["profiles", "list"]])
def test_help_has_examples(cmd: list[str]) -> None:
    res = runner.invoke(app, [*cmd, "--help"])
    assert res.exit_code == 0, res.output
    assert "Example" in res.output


def test_cli_import_does_not_import_torch() -> None:
    code = "import sys, nsa, nsa_cli.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_completion_is_available() -> None:
    res = runner.invoke(app, ["--help"])
    assert "--install-completion" in res.output and "--show-completion" in res.output


@pytest.mark.parametrize("module", ["preflight", "smoke", "watch", "halt", "dump", "report", "export", "profiles"])
def test_help_examples_parse(module: str) -> None:
    import importlib

    from tests.conftest import parse_cli, split_command

    epilog = importlib.import_module(f"nsa_cli.commands.{module}").EPILOG
    examples = []
    for line in epilog.splitlines():
        if line.strip().startswith(("nsa ", "NSA_")):
            _, tokens = split_command(line.strip())
            assert tokens[:1] == ["nsa"], line
            examples.append(tokens[1:])
    assert examples
    for argv in examples:
        assert parse_cli(argv), argv
