"""Spellings the CLI had before its conventions were made one (deprecated, read until the date of
:data:`nsa.deprecation.PRE_RELEASE_UNTIL`; a test fails once it has passed).

- ``--json`` prints JSON to stdout in every command; the five commands that wrote a file with ``--json PATH``
  (``nsa eval``, ``nsa bench attention|train|decode|retrieval``) take ``--json-out PATH`` for that, and
  still read ``--json PATH`` (``--json -`` as ``--json``).
- A short flag means one thing in every command: ``-p`` is ``--profile``, ``-o`` is ``--out-dir``. ``nsa
  sample -p TEXT`` (``--prompt``) and ``nsa report -o PATH`` (``--out``) are still read.

Each old spelling is rewritten to today's before the command parses its arguments, with one line on
stderr: ``warning: ... is deprecated ...: use ...``. The commands declare only today's options, so
``--help`` and the option table of every command show one meaning per flag.

:class:`Command` also completes its options when they are first read (parsing or help, never at import nor for
``nsa --help``): the shipped config names in ``--config``'s help, and a subclass's derived options
(``nsa train``'s flags, from the config's metadata).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from itertools import islice
from typing import Any, ClassVar

import typer
from typer.core import TyperCommand

from nsa_cli import render
from nsa_cli.options import CONFIG_NAMES, request_params


def deprecation(old: str, new: str, why: str = "") -> str:
    """The one stderr line of a deprecated spelling (the date is the library's: ``nsa.config.legacy``)."""
    from nsa.config.legacy import deprecated_spelling

    return deprecated_spelling(old, new, why)


class Command(TyperCommand):
    """A command that still reads its deprecated spellings (see the module docstring). Subclasses (made by
    :func:`command_class`) set the tables; a command without any is a plain Typer command."""

    short_aliases: ClassVar[dict[str, tuple[str, str]]] = {}  # "-p" -> ("--prompt", why)
    json_path: ClassVar[bool] = False  # --json PATH (old) -> --json-out PATH
    # the library's texts a help shows ({"{rules}": ...}), read when it is shown (so nsa --help stays light)
    texts: ClassVar[Callable[[], dict[str, str]] | None] = None
    derive_first: ClassVar[bool] = True
    _params: list[Any]
    _complete = False

    def derive(self) -> list[inspect.Parameter]:
        """Options derived from the library when the command is first read (none here)."""
        return []
    _epilog: str | None = None

    @property  # type: ignore[override]
    def epilog(self) -> str | None:
        texts = type(self).texts
        if self._epilog and texts is not None:
            return functools.reduce(lambda text, kv: text.replace(*kv), texts().items(), self._epilog)
        return self._epilog

    @epilog.setter
    def epilog(self, value: str | None) -> None:
        self._epilog = value

    @property  # type: ignore[override]
    def params(self) -> list[Any]:
        if not self._complete:
            self._complete = True
            self._params = self.complete(self._params)
        return self._params

    @params.setter
    def params(self, value: list[Any]) -> None:
        self._params, self._complete = value, False

    def complete(self, params: list[Any]) -> list[Any]:
        """The options as the command reads them: those :meth:`derive` adds (the command's own ``**fields``
        filled in, before its other options with ``derive_first``), and ``{configs}`` in a help replaced by
        the shipped names."""
        extra = self.derive()
        if extra:
            fn = self.callback.__wrapped__  # type: ignore[union-attr]
            sig = inspect.signature(fn, eval_str=True)
            base = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]

            def full(**kwargs: Any) -> Any:
                return fn(**kwargs)

            full.__signature__ = sig.replace(  # type: ignore[attr-defined]
                parameters=[*extra, *base] if self.derive_first else [*base, *extra])
            sub = typer.Typer(add_completion=False)
            sub.command()(full)
            built = typer.main.get_command(sub)
            self.callback, params = built.callback, [*built.params]
        if any(CONFIG_NAMES in (getattr(p, "help", None) or "") for p in params):
            from nsa.config import named_configs

            for p in params:
                if CONFIG_NAMES in (getattr(p, "help", None) or ""):
                    p.help = p.help.replace(CONFIG_NAMES, ", ".join(named_configs()))
        return params

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        new, lines = self.upgrade(list(args))
        if not ctx.resilient_parsing:
            for line in lines:
                render.echo(line, err=True)
        return super().parse_args(ctx, new)

    # -- the rewrite --------------------------------------------------------------------------------
    def _takes_value(self) -> set[str]:
        names: set[str] = set()
        for p in self.params:
            if p.param_type_name == "option" and not getattr(p, "is_flag", False) and not getattr(p, "count",
                False):
                names.update(p.opts)
        return names

    def _positional_room(self) -> float:
        room = 0.0
        for p in self.params:
            if p.param_type_name == "argument":
                room += float("inf") if p.nargs == -1 else p.nargs
        return room

    def upgrade(self, args: list[str]) -> tuple[list[str], list[str]]:
        """``args`` with deprecated spellings replaced by today's, and one warning line per replacement. An
        option's value and everything after ``--`` are kept as given (``--prompt -p``: the prompt is
        ``-p``)."""
        takes = self._takes_value()
        lines: list[str] = []
        out: list[str] = []
        it = iter(args)
        for tok in it:
            if tok == "--":
                out += [tok, *it]
                break
            short = tok[:2]
            if short in self.short_aliases and (tok == short or not tok.startswith("--")):
                long, why = self.short_aliases[short]
                lines.append(deprecation(short, long, why))
                out += [long, tok[2:]] if len(tok) > 2 else [long]
                if len(tok) == 2 and long in takes:
                    out.extend(islice(it, 1))
                continue
            out.append(tok)
            if tok in takes:
                out.extend(islice(it, 1))
        if self.json_path:
            out = self._json_path(out, lines)
        return out, lines

    def _json_path(self, args: list[str], lines: list[str]) -> list[str]:
        """``--json PATH`` / ``--json=PATH`` -> ``--json-out PATH``; ``--json -`` -> ``--json``. A token after
        ``--json`` is its old value only when the command has no room for it as a positional argument."""
        takes = self._takes_value()
        positionals, candidate = 0, None
        i = 0
        while i < len(args):
            tok = args[i]
            if tok == "--":
                positionals += len(args) - i - 1
                break
            if tok == "--json" and i + 1 < len(args) and (args[i + 1] == "-"
                                                          or not args[i + 1].startswith("-")):
                candidate = i
                positionals += 1
                i += 2
                continue
            if tok in takes:
                i += 2
                continue
            if tok == "-" or not tok.startswith("-"):
                positionals += 1
            i += 1
        out = list(args)
        for i, tok in enumerate(out):
            if tok.startswith("--json="):
                value = tok.split("=", 1)[1]
                out[i] = "--json" if value == "-" else f"--json-out={value}"
                lines.append(self._json_line(value))
        if candidate is not None and positionals > self._positional_room():
            value = out[candidate + 1]
            out[candidate:candidate + 2] = ["--json"] if value == "-" else ["--json-out", value]
            lines.append(self._json_line(value))
        return out

    @staticmethod
    def _json_line(value: str) -> str:
        if value == "-":
            return deprecation("--json -", "--json", "it prints the JSON to stdout")
        return deprecation("--json PATH", "--json-out PATH", "--json alone prints the JSON to stdout")


def command_class(*, json_path: bool = False, short: dict[str, tuple[str, str]] | None = None,
                  texts: Callable[[], dict[str, str]] | None = None,
                  request: Callable[[], type] | None = None, first: bool = True) -> type[Command]:
    """A :class:`Command` subclass that reads ``--json PATH`` (``json_path``) and the short flags ``short``
    (``{"-p": ("--prompt", why)}``) as their deprecated spellings, fills ``texts()`` into its epilog, and
    takes its options from the fields of the library's typed request ``request()``
    (:func:`nsa_cli.options.request_params`; ``first``: before the command's other options)."""
    body: dict[str, Any] = {"json_path": json_path, "short_aliases": dict(short or {}), "derive_first": first,
                            "texts": staticmethod(texts) if texts else None}
    if request is not None:
        body["derive"] = lambda self: request_params(request())
    return type("Command", (Command,), body)
