"""Options shared by the commands, declared once so that they read the same everywhere: ``--json`` (JSON on
stdout), ``--json-out PATH`` (JSON to a file), ``--config`` (the shipped config names, filled in by
:class:`nsa_cli.compat.Command` from ``nsa.config.named_configs``), ``--set``, ``--profile``, ``--out-dir``
and the run-directory argument (a ``Path`` in every command); and the parsing of comma-separated lists."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Annotated, Any

import typer

from nsa_cli.errors import fail

# in an option's help: the shipped config names, filled in when the options are read (nsa_cli.compat.Command)
CONFIG_NAMES = "{configs}"

# a short flag means one thing in every command
SHORT = {"--config": "-c", "--profile": "-p", "--out-dir": "-o"}


def json_flag(what: str) -> Any:
    """``--json``: print ``what`` as JSON on stdout (and nothing else there)."""
    return typer.Option("--json", help=f"Print {what} as JSON on stdout.")


def json_out(what: str) -> Any:
    """``--json-out PATH``: write ``what`` as JSON to PATH (the older ``--json PATH`` is still read)."""
    return typer.Option("--json-out", help=f"Write {what} as JSON to this file ('-': stdout, as --json).")


# the benchmarks' JSON options
RowsJson = Annotated[bool, json_flag("rows and environment")]
RowsJsonOut = Annotated[Path | None, json_out("rows and environment")]


def config(what: str = "Run config") -> Any:
    """``--config``/``-c``: a shipped name or a YAML path."""
    return typer.Option("--config", "-c", help=f"{what}: a shipped name ({CONFIG_NAMES}) or a YAML path.")


def sets(what: str = "Config override section.key=value") -> Any:
    """``--set section.key=value`` (repeatable)."""
    return typer.Option("--set", help=f"{what}; repeatable.")


def profile(what: str = "Hardware profile name or YAML path.") -> Any:
    return typer.Option("--profile", "-p", help=what)


def out_dir(what: str) -> Any:
    return typer.Option("--out-dir", "-o", help=what)


def run_dir(help: str = "Run directory (train.out_dir).") -> Any:
    """The run-directory argument of watch, halt, dump, sample and eval (a ``Path`` everywhere)."""
    return typer.Argument(help=help)


def ints(text: str | None, flag: str, example: str = "2048,8192", kilo: bool = False,
         zero: bool = False) -> list[int] | None:
    """The positive integers of a comma-separated ``text`` (``kilo``: ``4k`` = 4096; ``zero``: any integer, a
    seed); one line, exit 2, otherwise. ``None`` stays ``None`` (the option not given)."""
    if text is None:
        return None
    out = []
    for part in text.replace(" ", "").split(","):
        scale = 1024 if kilo and part[-1:] in ("k", "K") else 1
        try:
            out += [int(part[:-1] if scale > 1 else part) * scale] if part else []
        except ValueError:
            raise fail(f"{flag} {text!r} must be comma-separated integers",
                       hint=f"e.g. {flag} {example}") from None
    if not out or (not zero and any(v < 1 for v in out)):
        raise fail(f"{flag} {text!r} must list positive integers", hint=f"e.g. {flag} {example}")
    return out


def request_params(cls: Any) -> list[inspect.Parameter]:
    """A library request's fields that are options (``nsa.view.option``) as the parameters Typer reads: the
    flag, help and bounds of each, a comma-separated list as its text, a repeated option as a list."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        m = f.metadata
        if "flag" not in m:
            continue
        default: Any = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        hint: Any = hints[f.name]
        kind = m["kind"]
        if kind == "config":
            opt = config(m["help"])
        elif kind == "profile":
            opt = profile(m["help"])
        elif kind == "sets":
            opt, hint, default = sets(m["help"]), list[str] | None, None
        else:
            decls = [f"{m['flag']}/--no-{m['flag'][2:]}"] if m["switch"] else [m["flag"]]
            short = [SHORT[m["flag"]]] if m["flag"] in SHORT else []
            opt = typer.Option(*decls, *short, help=m["help"] or None, min=m["min"], max=m["max"])
        if kind in ("ints", "seeds", "csv"):
            hint, default = str | None, None if default is None else ",".join(map(str, default))
        elif kind == "repeat":  # list[X] or list[X] | None: the option given once per X
            items = next(a for a in (*typing.get_args(hint), hint) if typing.get_origin(a) is list)
            hint, default = list[typing.get_args(items)[0]] | None, None  # type: ignore[misc]
        out.append(inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                     annotation=Annotated[hint, opt]))
    return out


def request(cls: Any, values: dict[str, Any]) -> Any:
    """The request ``cls`` of the values given (a comma list parsed; an option not given: the request's
    default)."""
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}
    out = {}
    for name, v in values.items():
        kind, flag = meta[name].get("kind"), meta[name].get("flag", "")
        if v is None or (kind in ("repeat", "sets") and not v):
            continue
        if kind in ("ints", "seeds"):
            v = ints(v, flag, "0,1" if kind == "seeds" else "2048,8192", zero=kind == "seeds")
        elif kind == "csv":
            v = [x for x in v.replace(" ", "").split(",") if x]
        out[name] = list(v) if kind in ("repeat", "sets") else v
    return cls(**out)
