"""``NSA_*`` environment settings: the only place the process environment is read for them.

Each field of :data:`NSASettings` is one variable (``NSA_<FIELD>``) and maps to one run-config key
(:data:`ENV_TO_CONFIG`); both are derived from the run config's field metadata (``exposed(env=...)``, see
:mod:`nsa.config.fields`). Unknown ``NSA_*`` names are reported so that typos never pass silently.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

from pydantic import Field, ValidationError, ValidationInfo, create_model, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from nsa.config.fields import config_fields, env_keys
from nsa.config.files import shorten
from nsa.config.legacy import CONFIG_VAR, legacy_hint, removed_hint
from nsa.config.legacy import LEGACY_VARS as LEGACY_VARS  # re-exported: the older system's knobs
from nsa.config.section import reject_bool
from nsa.errors import ConfigError

PREFIX = "NSA_"


class SettingsBase(BaseSettings):
    """The base of :data:`NSASettings`: values only from the arguments, no booleans for numbers, and
    ``NSA_PROFILE`` (a profile name, not a config key)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", case_sensitive=False)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        return value if field is None else reject_bool(value, field.annotation)

    profile: str | None = Field(None, description="hardware profile name (like --profile)")


def _field_name(var: str) -> str:
    """``NSA_PREFETCH_DEPTH`` -> ``prefetch_depth``."""
    return var[len(PREFIX):].lower()


def _setting_fields() -> dict[str, Any]:
    """One optional field per ``NSA_*`` variable of the config's metadata, typed like the key it sets."""
    fields: dict[str, Any] = {}
    for var, dotted in env_keys().items():
        info = config_fields()[dotted]
        fields[_field_name(var)] = (Optional[info.annotation],  # noqa: UP045
                                    Field(None, description=info.description))
    return fields


# Every NSA_* variable the toolkit understands, one field each (unset: None). Values come only from the
# arguments (``read_settings`` passes the environment mapping it is given): pydantic-settings would otherwise
# fill missing fields from ``os.environ``. The fields are derived from the run config's metadata
# (``exposed(env=...)``), so a variable and the key it sets are declared once, next to each other.
NSASettings: type[SettingsBase] = create_model(  # type: ignore[call-overload]
    "NSASettings", __base__=SettingsBase, __module__=__name__, **_setting_fields()
)

# field name -> dotted run-config key ("_profile" is the profile name, not a config key)
ENV_TO_CONFIG: dict[str, str] = {"profile": "_profile", **{_field_name(v): k for v, k in env_keys().items()}}


KNOWN = {PREFIX + name.upper() for name in NSASettings.model_fields}


def _environ(environ: dict[str, str] | None) -> dict[str, str]:
    return dict(os.environ) if environ is None else dict(environ)


def describe_unknown(name: str, value: str | None = None) -> str:
    """An unknown ``NSA_*`` name (with the ``value`` it is set to, when given) and what replaced it: the
    older system's knob, with a hint that depends on the value (``NSA_USE_FA2=0`` needs nothing set), a
    variable an earlier version read (``NSA_WINDOW_BACKEND``), or the closest known name."""
    import difflib

    upper = name.upper()
    shown = name if value is None else f"{name}={value}"
    hint = legacy_hint(upper, value)
    if hint is not None:
        return f"{shown} (older system: {hint})"
    hint = removed_hint(upper, value)
    if hint is not None:
        return f"{shown} ({hint})"
    close = difflib.get_close_matches(upper, sorted(KNOWN), n=1)
    return f"{shown} (did you mean {close[0]}?)" if close else shown


def describe_unknown_env(environ: dict[str, str] | None = None) -> list[str]:
    """:func:`describe_unknown` for every unknown ``NSA_*`` variable of ``environ`` (``None``:
    ``os.environ``)."""
    env = _environ(environ)
    return [describe_unknown(n, env.get(n)) for n in unknown_variables(env)]


def config_from_env(environ: dict[str, str] | None = None) -> str | None:
    """The older system's ``CONFIG=path`` (its config file variable), or None when unset or empty."""
    value = _environ(environ).get(CONFIG_VAR, "").strip()
    return value or None


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """``NSA_*`` names in the environment that no setting reads (likely typos)."""
    env = _environ(environ)
    return sorted(k for k in env if k.upper().startswith(PREFIX) and k.upper() not in KNOWN)


def read_settings(environ: dict[str, str] | None = None) -> SettingsBase:
    """Settings from ``environ`` only (``None``: ``os.environ``)."""
    env = {k: v for k, v in _environ(environ).items() if k.upper() in KNOWN}
    try:
        # values come from the mapping we pass, so tests can give an explicit environment
        return NSASettings.model_validate(
            {k.upper()[len(PREFIX):].lower(): v for k, v in env.items()}
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        name = PREFIX + str(err["loc"][0]).upper()
        raise ConfigError(
            f"{name}={shorten(err.get('input'))}: {err['msg']}", hint=f"fix or unset {name}"
        ) from None


def env_overlay(environ: dict[str, str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Set variables as ``{section: {key: (value, VAR)}}`` (plus ``_profile``), and unknown names."""
    settings = read_settings(environ)
    layer: dict[str, Any] = {}
    for name, value in settings.model_dump(exclude_none=True).items():
        dotted = ENV_TO_CONFIG[name]
        if dotted == "_profile":
            layer["_profile"] = value
            continue
        section, key = dotted.split(".")
        layer.setdefault(section, {})[key] = (value, PREFIX + name.upper())
    return layer, unknown_variables(environ)


def settings_table(environ: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Rows ``{variable, config_key, value, description}`` for every known setting."""
    settings = read_settings(environ)
    rows = []
    for name, info in NSASettings.model_fields.items():
        rows.append(
            {
                "variable": PREFIX + name.upper(),
                "config_key": ENV_TO_CONFIG[name],
                "value": getattr(settings, name),
                "description": info.description or "",
            }
        )
    return rows


@functools.lru_cache(maxsize=1)
def get_settings() -> SettingsBase:
    """Settings of this process, read once (``reload_settings`` to read again)."""
    return read_settings()


def reload_settings() -> SettingsBase:
    get_settings.cache_clear()
    return get_settings()
