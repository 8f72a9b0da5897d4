"""``nsa profiles list|show``: the hardware profiles and the settings they resolve to."""

from __future__ import annotations

from typing import Annotated

import typer

from nsa_cli import options
from nsa_cli.compat import Command
from nsa_cli.errors import user_errors
from nsa_cli.render import Output

EPILOG = """\
Examples:

  nsa profiles list

  nsa profiles show h100-80g

  nsa profiles show cpu --config tiny --json

  NSA_PREFETCH_DEPTH=16 nsa profiles show a100-80g --config m7c-125m   # the env value wins

Precedence, lowest to highest: defaults < config < profile < NSA_* environment < flags.
"""

profiles_app = typer.Typer(
    help="List hardware profiles and show what one resolves to (and where each value comes from).",
    no_args_is_help=True,
    epilog=EPILOG,
)


@profiles_app.command("list", epilog="Example: nsa profiles list --json", cls=Command)
def list_cmd(as_json: Annotated[bool, options.json_flag("the profiles")] = False) -> None:
    """Every shipped profile with its GPU expectation and training defaults."""
    with user_errors():
        from nsa.config.show import profile_list

        profiles = profile_list()
    raise typer.Exit(Output(as_json).result(profiles))


@profiles_app.command("show", epilog=EPILOG, cls=Command)
def show_cmd(
    name: Annotated[str, typer.Argument(help="Profile name or YAML path.")],
    config: Annotated[str | None, options.config("Run config to resolve against")] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Also list keys left at their defaults.")] = False,
    as_json: Annotated[bool, options.json_flag("the profile and the resolved config")] = False,
) -> None:
    """The profile's expectations and the resolved run config with the origin of every value."""
    with user_errors():
        from nsa.config.show import show_profile

        shown = show_profile(name, config, show_all)
    raise typer.Exit(Output(as_json).result(shown))


def register(app: typer.Typer) -> None:
    app.add_typer(profiles_app, name="profiles")
