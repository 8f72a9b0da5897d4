"""``NSA_*`` environment settings: the only place the process environment is read for them.

Each field of :class:`NSASettings` is one variable (``NSA_<FIELD>``) and maps to one run-config key
(:data:`ENV_TO_CONFIG`). Unknown ``NSA_*`` names are reported so that typos never pass silently.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from nsa.config.legacy import CONFIG_VAR, legacy_hint
from nsa.config.legacy import LEGACY_VARS as LEGACY_VARS  # re-exported: the older system's knobs
from nsa.config.section import reject_bool
from nsa.errors import ConfigError

PREFIX = "NSA_"

# field name -> dotted run-config key ("_profile" is the profile name, not a config key)
ENV_TO_CONFIG: dict[str, str] = {
    "profile": "_profile",
    "device": "runtime.device",
    "precision": "runtime.precision",
    "attn_backend": "runtime.attn_backend",
    "window_backend": "runtime.window_backend",
    "compile": "runtime.compile",
    "compile_mode": "runtime.compile_mode",
    "grad_ckpt": "runtime.gradient_checkpointing",
    "parallel": "runtime.parallel",
    "deterministic": "runtime.deterministic",
    "tf32": "runtime.tf32",
    "alloc_conf": "runtime.alloc_conf",
    "steps": "train.steps",
    "seq_len": "train.seq_len",
    "batch_size": "train.batch_size",
    "accum": "train.accum",
    "lr": "train.lr",
    "seed": "train.seed",
    "out_dir": "train.out_dir",
    "save_every": "train.save_every",
    "dataset": "data.source",
    "data_path": "data.path",
    "tokenizer": "data.tokenizer",
    "prefetch_depth": "data.prefetch_depth",
    "loader_timeout": "data.timeout_s",
}


class NSASettings(BaseSettings):
    """Every ``NSA_*`` variable the toolkit understands. Unset fields are ``None``.

    Values come only from the arguments (``read_settings`` passes the environment mapping it is
    given): pydantic-settings would otherwise fill missing fields from ``os.environ``."""

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
    device: Literal["auto", "cpu", "cuda"] | None = None
    precision: Literal["auto", "fp32", "bf16", "fp16"] | None = None
    attn_backend: Literal["auto", "reference", "torch", "triton"] | None = Field(
        None, description="nsa.ops backend"
    )
    window_backend: Literal["auto", "triton", "flex", "flash", "torch"] | None = Field(
        None, description="sliding-window branch backend on GPU"
    )
    compile: bool | Literal["auto"] | None = None
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] | None = Field(
        None, description="torch.compile mode (reduce-overhead: CUDA graphs)"
    )
    grad_ckpt: bool | None = Field(None, description="gradient checkpointing")
    parallel: Literal["ddp", "fsdp"] | None = Field(None, description="data parallelism over several ranks")
    deterministic: bool | None = None
    tf32: bool | None = None
    alloc_conf: str | None = Field(None, description="PYTORCH_CUDA_ALLOC_CONF for the run")
    steps: int | None = None
    seq_len: int | None = None
    batch_size: int | None = None
    accum: int | None = None
    lr: float | None = None
    seed: int | None = None
    out_dir: str | None = None
    save_every: int | None = None
    dataset: str | None = Field(None, description="data source: embedded, local, synthetic, fineweb_edu")
    data_path: str | None = None
    tokenizer: str | None = None
    prefetch_depth: int | None = None
    loader_timeout: float | None = Field(None, description="dataset connect/first-batch timeout, seconds")


KNOWN = {PREFIX + name.upper() for name in NSASettings.model_fields}


def _environ(environ: dict[str, str] | None) -> dict[str, str]:
    return dict(os.environ) if environ is None else dict(environ)


def describe_unknown(name: str, value: str | None = None) -> str:
    """An unknown ``NSA_*`` name (with the ``value`` it is set to, when given) and what replaced it: the
    older system's knob, with a hint that depends on the value (``NSA_USE_FA2=0`` needs nothing set), or the
    closest known name."""
    import difflib

    upper = name.upper()
    shown = name if value is None else f"{name}={value}"
    hint = legacy_hint(upper, value)
    if hint is not None:
        return f"{shown} (older system: {hint})"
    close = difflib.get_close_matches(upper, sorted(KNOWN), n=1)
    return f"{shown} (did you mean {close[0]}?)" if close else shown


def describe_unknown_env(environ: dict[str, str] | None = None) -> list[str]:
    """:func:`describe_unknown` for every unknown ``NSA_*`` variable of ``environ`` (``None``: ``os.environ``)."""
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


def read_settings(environ: dict[str, str] | None = None) -> NSASettings:
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
            f"{name}={err.get('input')!r}: {err['msg']}", hint=f"fix or unset {name}"
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
def get_settings() -> NSASettings:
    """Settings of this process, read once (``reload_settings`` to read again)."""
    return read_settings()


def reload_settings() -> NSASettings:
    get_settings.cache_clear()
    return get_settings()
