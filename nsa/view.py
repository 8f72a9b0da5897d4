"""What a library call returns to the CLI: a :class:`Result`, read by a program as JSON (``to_dict``) and by a
person as a view (``view``): :class:`Line` and :class:`Table` blocks, data only. The CLI renders them
(``nsa_cli. render``, with Rich); the library never imports a terminal library. A style is a name the renderer
maps (``good``, ``bad``, ``caution``, ``headline``, ``dim``, ``ok``/``warn``/``poor`` for cells, or a
colour)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nsa.fileio import json_safe

Cell = str | tuple[str, str]  # a table cell: text, or (text, style)


@dataclass
class Line:
    """One line of text (printed verbatim), in ``style`` (its first ``lead`` characters only, when given).
    ``err``: on standard error whatever the command's output mode (a warning); ``wrap``: wrapped at the
    terminal's width (else one line however long: a log line, a stack)."""

    text: str
    style: str = ""
    err: bool = False
    lead: int = 0
    wrap: bool = True


@dataclass
class Column:
    name: str
    justify: str = "right"
    style: str = ""
    no_wrap: bool = False


@dataclass
class Table:
    """A table: ``title`` above it (``title_left``: flush left), ``caption`` under it."""

    title: str | None
    columns: list[Column]
    rows: list[list[Cell]] = field(default_factory=list)
    caption: str | None = None
    title_left: bool = False

    @classmethod
    def of(cls, title: str | None, names: list[str] | tuple[str, ...], justify: str = "right",
           **kwargs: Any) -> Table:
        """A table whose columns are ``names``, each justified alike."""
        return cls(title, [Column(n, justify) for n in names], **kwargs)

    def add(self, *cells: Cell) -> None:
        self.rows.append(list(cells))


Block = Line | Table


def fig(x: float | None, spec: str = ".3g", none: str = "-") -> str:
    """A figure of a table: ``x`` formatted by ``spec``, ``none`` when not measured."""
    return none if x is None else format(x, spec)


def json_default(obj: Any) -> Any:
    """What ``json.dumps`` writes for what it cannot: an object's ``to_dict()``, a set sorted, else its
    text."""
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, set):
        return sorted(obj)
    return str(obj)


class Result(ABC):
    """A library call's answer to a command: ``to_dict()`` (the ``--json`` payload, every result's own),
    ``view()`` (what a person reads) and ``exit_code`` (0 unless the result is a failure the command reports
    with its code)."""

    json_indent = 2

    @abstractmethod
    def to_dict(self) -> Any:
        """The ``--json`` payload."""

    def view(self) -> list[Block]:
        return []

    @property
    def exit_code(self) -> int:
        return 0

    def to_json(self) -> str:
        """The payload as JSON text for standard output: non-finite numbers as null, paths as text."""
        return json.dumps(json_safe(self.to_dict()), indent=2, default=json_default, allow_nan=False)

    def json_file_text(self) -> str:
        """The payload as a ``--json-out`` file holds it (as written since the flag exists: numbers as they
        are, indented by ``json_indent``)."""
        return json.dumps(self.to_dict(), indent=self.json_indent, default=json_default)


@dataclass
class Payload(Result):
    """A result that is a JSON payload and a view made beforehand (the benchmarks')."""

    payload: Any
    blocks: list[Block] = field(default_factory=list)
    indent: int = 2
    code: int = 0
    saved: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.json_indent = self.indent

    def to_dict(self) -> Any:
        return self.payload

    def view(self) -> list[Block]:
        return self.blocks

    @property
    def exit_code(self) -> int:
        return self.code


def option(default: Any, flag: str, help: str = "", *, kind: str = "", min: float | None = None,
           max: float | None = None, switch: bool = False) -> Any:
    """A request's field that is a command-line option (``dataclasses.field``): its ``flag`` (``switch``: also
    ``--no-...``), ``help``, bounds, and ``kind``, how the command line's text becomes the value: ``ints``
    (comma-separated positive integers), ``seeds`` (comma-separated integers), ``csv`` (comma-separated
    words), ``repeat`` (the option given again for each value), ``config``/``sets`` (the CLI's shared
    ``--config`` and ``--set``, ``help`` saying what they configure)."""
    meta = {"flag": flag, "help": help, "kind": kind, "min": min, "max": max, "switch": switch}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
