"""The run config's fields by dotted key, and the maps derived from their metadata (one place).

A field declared with ``json_schema_extra=exposed(env="NSA_LR", flag="--lr")`` (:func:`nsa.config.section.exposed`)
is set by that ``NSA_*`` variable and that ``nsa train`` flag. :mod:`nsa.config.settings` builds its fields
and its variable -> key map from :func:`env_keys`, the CLI its flag -> key map from :func:`flag_keys`.
"""

from __future__ import annotations

import functools

from pydantic.fields import FieldInfo

from nsa.config.run import RunConfig
from nsa.config.section import exposed_as


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
            raise RuntimeError(f"{what} {name} is declared by {out[name]} and {dotted}")  # a code bug, caught by tests
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
