"""Hardware profiles (``profiles/*.yaml``): what a machine should look like and how to run on it.

A profile has four parts:

- ``expect``: the hardware preflight compares against (GPU name pattern, memory, compute capability,
  GPU count, flash-attn, bf16);
- ``settings``: runtime settings written as ``NSA_*`` names (or their field names), validated by the
  ``NSASettings`` model of :mod:`nsa.config.settings` and mapped to run-config keys through ``ENV_TO_CONFIG``;
- ``train``: training defaults (batch size, accumulation, sequence length);
- ``smoke``: the criteria and run size of ``nsa smoke``.

``settings`` and ``train`` apply at profile precedence: above the config file, below the real
environment and command-line flags (see :func:`nsa.config.load_run_config`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nsa.config.files import format_validation_error, read_yaml
from nsa.config.monitor import MonitorConfig
from nsa.config.settings import ENV_TO_CONFIG, PREFIX, NSASettings
from nsa.errors import ConfigError

PROFILE_DIRS = [Path(__file__).resolve().parents[2] / "profiles",
                Path(__file__).resolve().parents[1] / "_profiles"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProfileExpect(_Strict):
    """Hardware expectations that preflight checks."""

    device: Literal["cpu", "cuda"] = "cuda"
    gpu_name_pattern: str | None = Field(None, description="regular expression, case-insensitive")
    min_memory_gib: float | None = Field(None, ge=0, description="per GPU")
    min_compute_capability: float | None = Field(None, ge=0, description="e.g. 8.0 for Ampere")
    gpu_count: int = Field(0, ge=0, description="minimum number of visible GPUs")
    requires_flash_attn: bool = False
    requires_triton: bool = False
    bf16: bool = Field(False, description="bf16 must be supported")
    min_ram_gib: float = Field(1.0, ge=0)
    min_disk_gib: float = Field(1.0, ge=0, description="free space at the output directory")

    @field_validator("gpu_name_pattern")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return value


class ProfileTrain(_Strict):
    """Training defaults of the machine (applied to the ``train`` section)."""

    batch_size: int | None = Field(None, ge=1)
    accum: int | None = Field(None, ge=1)
    seq_len: int | None = Field(None, ge=2)


class ProfileSmoke(_Strict):
    """What ``nsa smoke`` runs and the criteria of its verdict."""

    config: str = "tiny"
    steps: int = Field(200, ge=2)
    sets: list[str] = Field(default_factory=list, description="--set overrides for the smoke run")
    min_tokens_per_s: float = Field(0.0, ge=0)
    max_fetch_p95_ms: float = Field(1000.0, gt=0)
    max_heartbeat_age_s: float = Field(120.0, gt=0)
    min_gate_entropy: float = Field(0.05, ge=0, description="mean gate entropy (nats) at the end")
    max_gate_collapse: float = Field(0.5, ge=0, le=1, description="collapsed-gate fraction at the end")
    min_loss_drop: float = Field(0.0, ge=0, description="last loss must be below first by this much")
    parity_atol: float = Field(2e-3, gt=0, description="parity tolerance against the reference (fp32)")


class Profile(_Strict):
    """One hardware profile."""

    name: str
    description: str = ""
    expect: ProfileExpect = Field(default_factory=ProfileExpect)
    settings: dict[str, Any] = Field(default_factory=dict)
    train: ProfileTrain = Field(default_factory=ProfileTrain)
    smoke: ProfileSmoke = Field(default_factory=ProfileSmoke)
    monitor: dict[str, Any] = Field(default_factory=dict,
                                    description="monitor.* values (watch thresholds, report limits)")
    path: str | None = None

    @field_validator("monitor", mode="before")
    @classmethod
    def _monitor(cls, value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError("must be a mapping of monitor keys to values")
        unknown = sorted(set(value) - set(MonitorConfig.model_fields))
        if unknown:
            raise ValueError(f"unknown monitor key(s) {', '.join(unknown)}")
        MonitorConfig.model_validate(value)
        return dict(value)

    @field_validator("settings", mode="before")
    @classmethod
    def _settings(cls, value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError("must be a mapping of NSA_* names to values")
        fields: dict[str, Any] = {}
        for key, item in value.items():
            field = _field_name(str(key))
            if field in fields:
                raise ValueError(f"{key} is given twice")
            fields[field] = item
        try:
            validated = NSASettings.model_validate(fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = PREFIX + str(err["loc"][0]).upper()
            raise ValueError(f"{name}={err.get('input')!r}: "
                             f"{str(err['msg']).removeprefix('Value error, ')}") from None
        return {k: getattr(validated, k) for k in fields}

    @model_validator(mode="after")
    def _no_conflicts(self) -> Profile:
        for key in ("batch_size", "accum", "seq_len"):
            if getattr(self.train, key) is not None and key in self.settings:
                raise ValueError(f"train.{key} and settings {PREFIX}{key.upper()} both set; keep one")
        return self

    def env(self) -> dict[str, str]:
        """The settings as ``NSA_*`` variables (strings, as a shell would export them)."""
        out = {}
        for field, value in self.settings.items():
            text = str(value).lower() if isinstance(value, bool) else str(value)
            out[PREFIX + field.upper()] = text
        return out

    def config_overlay(self) -> dict[str, Any]:
        """Nested run-config sections that this profile sets (the profile precedence layer)."""
        tree: dict[str, Any] = {}
        for field, value in self.settings.items():
            section, key = ENV_TO_CONFIG[field].split(".")
            tree.setdefault(section, {})[key] = value
        for key, value in self.train.model_dump(exclude_none=True).items():
            tree.setdefault("train", {})[key] = value
        for key, value in self.monitor.items():
            tree.setdefault("monitor", {})[key] = value
        return tree


def _field_name(key: str) -> str:
    """``NSA_PREFETCH_DEPTH`` or ``prefetch_depth`` -> ``prefetch_depth`` (unknown names rejected)."""
    field = key[len(PREFIX):] if key.upper().startswith(PREFIX) else key
    field = field.lower()
    if field not in ENV_TO_CONFIG or field == "profile":
        known = ", ".join(PREFIX + f.upper() for f in ENV_TO_CONFIG if f != "profile")
        raise ValueError(f"unknown setting {key!r} (known: {known})")
    return field


def profile_dirs() -> list[Path]:
    """Folders searched for ``NAME.yaml``: the repository's ``profiles/``, then the installed copy."""
    return [d for d in PROFILE_DIRS if d.is_dir()]


def profile_names() -> list[str]:
    names: set[str] = set()
    for d in profile_dirs():
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def find_profile(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    for d in profile_dirs():
        f = d / f"{name_or_path}.yaml"
        if f.is_file():
            return f
    raise ConfigError(
        f"profile '{name_or_path}' not found",
        hint=f"give a YAML path or one of: {', '.join(profile_names()) or '(none installed)'}",
    )


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name, or a profile YAML by path, validated."""
    path = find_profile(name_or_path)
    data = read_yaml(path, "profile")
    data.setdefault("name", path.stem)
    try:
        prof = Profile.model_validate({**data, "path": str(path)})
    except ValidationError as exc:
        raise ConfigError(
            f"profile {path}: {format_validation_error(exc)}",
            hint="see profiles/cpu.yaml for the shape (name, expect, settings, train, smoke)",
        ) from None
    return prof


def list_profiles() -> list[Profile]:
    """Every shipped profile, validated (an invalid one raises ``ConfigError``)."""
    return [load_profile(n) for n in profile_names()]
