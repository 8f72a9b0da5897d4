"""The run config's fields by dotted key, and the maps derived from their metadata (one place).

A field declared with ``json_schema_extra=exposed(env="NSA_LR", flag="--lr")``
(:func:`nsa.config.section.exposed`) is set by that ``NSA_*`` variable and that ``nsa train`` flag.
:mod:`nsa.config.settings` builds its fields and its variable -> key map from :func:`env_keys`; the CLI builds
``nsa train``'s config flags from :func:`train_flags` and reads what was given with :func:`flag_values` and
:func:`flags_as_typed`.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from nsa.config.run import RunConfig
from nsa.config.section import exposed_as, numeric_kind


@functools.cache
def config_fields() -> dict[str, FieldInfo]:
    """Every leaf field of the run config: ``{"train.steps": FieldInfo, ...}`` in section order."""
    out: dict[str, FieldInfo] = {}
    for section, info in RunConfig.model_fields.items():
        fields = getattr(info.annotation, "model_fields", {})
        for key, field in fields.items():
            out[f"{section}.{key}"] = field
    return out


def _exposed(what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for dotted, info in config_fields().items():
        name = exposed_as(info, what)
        if name is None:
            continue
        if name in out:
            # a code bug, caught by tests
            raise RuntimeError(f"{what} {name} is declared by {out[name]} and {dotted}")
        out[name] = dotted
    return out


@functools.cache
def env_keys() -> dict[str, str]:
    """``{"NSA_STEPS": "train.steps", ...}``: every ``NSA_*`` variable that sets a config key."""
    return _exposed("env")


@functools.cache
def flag_keys() -> dict[str, str]:
    """``{"--steps": "train.steps", ...}``: every ``nsa train`` flag that sets a config key."""
    return _exposed("flag")


@functools.cache
def key_flags() -> dict[str, str]:
    """``{"train.steps": "--steps", ...}``: the flag of each key that has one (a value's origin names it)."""
    return {dotted: flag for flag, dotted in flag_keys().items()}


@dataclass(frozen=True)
class Flag:
    """An ``nsa train`` flag as its config field declares it: ``flag`` (``--seq-len``), the parameter ``name``
    (``seq_len``), the config ``key``, the value's ``kind`` (``int``, ``float``, ``str``; ``bool``: a
    ``--x/--no-x`` switch) and its ``help`` (the key and the field's description)."""

    flag: str
    name: str
    key: str
    kind: type
    help: str


def _kind(annotation: Any) -> type:
    args = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    if bool in args:
        return bool
    return {"integer": int, "number": float}.get(numeric_kind(annotation) or "", str)


@functools.cache
def train_flags() -> tuple[Flag, ...]:
    """Every ``nsa train`` flag that sets a config key, in the config's order."""
    fields = config_fields()
    return tuple(Flag(flag, flag.removeprefix("--").replace("-", "_"), key, _kind(fields[key].annotation),
                      f"{key}: {fields[key].description or key}.") for flag, key in flag_keys().items())


def flag_values(**values: Any) -> dict[str, Any]:
    """The flags that were given (not ``None``), by parameter name (``seq_len`` for ``--seq-len``), as
    ``{dotted key: value}`` for ``load_run_config``."""
    keys = flag_keys()
    return {keys[_flag(name)]: (str(v) if isinstance(v, Path) else v) for name,
            v in values.items() if v is not None}


def flags_as_typed(**values: Any) -> dict[str, str]:
    """``{dotted key: the flag as the user typed it}`` for each value's recorded origin (``data.source`` ->
    ``--dataset``; a ``--x/--no-x`` switch turned off -> ``--no-x``)."""
    keys = flag_keys()
    return {keys[_flag(name)]: (_flag(f"no_{name}") if v is False else _flag(name))
            for name, v in values.items() if v is not None}


def _flag(name: str) -> str:
    """A parameter's flag: ``seq_len`` -> ``--seq-len``."""
    return "--" + name.replace("_", "-")
