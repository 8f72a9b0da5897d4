"""The CLI stays a skin (issue 56), as ``scripts/structure_counts.py`` counts it: at most 1,800 lines, no command
function over 50 lines, at most 8 library parts imported, every command writing through the one output sink
(nothing printed outside ``nsa_cli/render``), and no script redoing library work."""

from __future__ import annotations

from pathlib import Path

from tests.script_module import script_module

ROOT = Path(__file__).resolve().parents[1]


def test_the_cli_is_a_skin() -> None:
    counts = script_module("structure_counts")
    skin, targets = counts.skin(ROOT), counts.TARGETS
    assert skin["cli_lines"] <= targets["cli_lines"]
    assert skin["longest_command_function"] <= targets["longest_command_function"], skin["longest_command"]
    assert skin["cli_library_parts"] <= targets["cli_library_parts"], counts.cli_imports(ROOT)
    sink = skin["output_sink"]
    assert sink["commands"] == 18 and sink["through_output"] == 18, sink
    assert len(skin["scripts_redoing_library"]) <= targets["scripts_redoing_library"], skin["scripts_redoing_library"]


def test_the_counts_see_what_they_count(tmp_path: Path) -> None:
    """A print outside the rendering module, and a script that patches the library or reads the profiler,
    are counted."""
    counts = script_module("structure_counts")
    (tmp_path / "nsa_cli" / "commands").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "nsa_cli" / "commands" / "x.py").write_text(
        "import typer\nfrom nsa_cli.render import Output\n\n\ndef a() -> None:\n    Output()\n\n\n"
        "def b() -> None:\n    typer.echo('x')\n\n\ndef register(app):\n    app.command('a')(a)\n    app.command('b')(b)\n")
    (tmp_path / "scripts" / "s.py").write_text("from nsa.model import attention\nattention.FLAG = False\n")
    (tmp_path / "scripts" / "p.py").write_text("from torch.profiler import profile\n")
    sink = counts.output_sink(tmp_path)
    assert sink["commands"] == 2 and sink["through_output"] == 0 and sink["not_through"] == ["x:b"]
    assert sink["prints_outside_render"] == ["nsa_cli/commands/x.py:10"]
    assert sorted(counts.scripts_redoing_library(tmp_path)) == ["p.py: reads the profiler",
                                                                "s.py:2: patches attention.FLAG"]
