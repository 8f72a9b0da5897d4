"""Resolving a run's config: defaults < config YAML < profile < ``NSA_*`` environment < flags < ``--set``,
with the origin of every value, and reading saved configs (older runs' defaults filled in)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from nsa.config.files import format_validation_error, read_yaml
from nsa.config.profiles import load_profile
from nsa.config.run import CONFIG_DIR, RunConfig
from nsa.config.settings import env_overlay
from nsa.errors import ConfigError


@dataclass
class ResolvedConfig:
    """A validated ``RunConfig`` with the origin of every value."""

    config: RunConfig
    sources: dict[str, str] = field(default_factory=dict)
    unknown_env: list[str] = field(default_factory=list)
    profile: str | None = None
    config_path: str | None = None

    def source_of(self, dotted: str) -> str:
        return self.sources.get(dotted, "default")


def named_configs() -> list[str]:
    """Names of the configs shipped with the package (``--config NAME``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def find_config(name_or_path: str | Path) -> Path:
    """A shipped config by name, or a YAML file by path."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = CONFIG_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    raise ConfigError(
        f"config '{name_or_path}' not found",
        hint=f"give a YAML path or one of: {', '.join(named_configs())}",
    )


def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(leaves(v, key + "."))
        else:
            out[key] = v
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"'{dotted}': '{p}' is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _check_keys(tree: dict[str, Any], origin: str) -> None:
    """Reject unknown sections/keys with the dotted name and where it came from."""
    sections = RunConfig.model_fields
    for dotted in leaves(tree):
        parts = dotted.split(".")
        if parts[0] not in sections:
            raise ConfigError(
                f"unknown section '{parts[0]}' ({origin})", hint=f"sections are: {', '.join(sections)}"
            )
        model_cls = sections[parts[0]].annotation
        fields = getattr(model_cls, "model_fields", {})
        if len(parts) < 2 or parts[1] not in fields:
            name = ".".join(parts[:2])
            raise ConfigError(
                f"unknown key '{name}' ({origin})", hint=f"keys of {parts[0]}: {', '.join(fields)}"
            )


def parse_set(item: str) -> tuple[str, Any]:
    """``section.key=value`` with the value read as YAML (so numbers and booleans are typed)."""
    if "=" not in item:
        raise ConfigError(f"--set '{item}' must look like section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if key.count(".") != 1:
        raise ConfigError(f"--set '{item}': key must be section.key (e.g. train.lr=3e-4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


# Fields added after runs were first saved, with the values that rebuild those runs' models exactly
# (today's defaults differ: see docs/design.md, "Gates").
LEGACY_DEFAULTS: dict[str, Any] = {"nsa.gate_bias": [0.0, 0.0, 0.0], "nsa.gate_scale": 1.0}


def fill_legacy(tree: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config saved by a run (``config.yaml``, a checkpoint) with the fields it predates set
    to ``LEGACY_DEFAULTS``, so that loading or resuming it rebuilds the model it was trained with."""
    out = copy.deepcopy(tree)
    for dotted, value in LEGACY_DEFAULTS.items():
        section, key = dotted.split(".", 1)
        sec = out.get(section)
        if isinstance(sec, dict) and key not in sec:
            sec[key] = copy.deepcopy(value)
    return out


def saved_run_config(tree: dict[str, Any]) -> RunConfig:
    """Validate a config saved by a run (see ``fill_legacy``)."""
    return validate_run_config(fill_legacy(tree))


def validate_run_config(tree: dict[str, Any], sources: dict[str, str] | None = None) -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, sources)) from None


def load_run_config(
    config: str | Path | None = None,
    profile: str | None = None,
    environ: dict[str, str] | None = None,
    flags: dict[str, Any] | None = None,
    sets: list[str] | None = None,
) -> ResolvedConfig:
    """Resolve a run config from its sources (see module docstring for precedence)."""

    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def apply(layer: dict[str, Any], origin: str) -> None:
        _check_keys(layer, origin)
        for dotted, value in leaves(layer).items():
            _set_dotted(tree, dotted, copy.deepcopy(value))
            sources[dotted] = origin

    config_path = None
    if config is not None:
        path = find_config(config)
        config_path = str(path)
        apply(read_yaml(path), f"config {path.name}")
    profile_name = None
    env_layer, unknown = env_overlay(environ)
    profile = profile or env_layer.pop("_profile", None)
    env_layer.pop("_profile", None)
    if profile:
        prof = load_profile(profile)
        profile_name = prof.name
        apply(prof.config_overlay(), f"profile {prof.name}")
    for dotted, (value, var) in leaves_with_vars(env_layer).items():
        apply(_nest(dotted, value), f"env {var}")
    for dotted, value in (flags or {}).items():
        if value is not None:
            apply(_nest(dotted, value), f"flag --{dotted.split('.')[-1].replace('_', '-')}")
    for item in sets or []:
        dotted, value = parse_set(item)
        apply(_nest(dotted, value), f"--set {dotted}")
    cfg = validate_run_config(tree, sources)
    return ResolvedConfig(cfg, sources, unknown, profile_name, config_path)


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _set_dotted(out, dotted, value)
    return out


def leaves_with_vars(env_layer: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """``env_overlay`` returns ``{dotted: (value, VAR_NAME)}`` leaves nested by section."""
    out: dict[str, tuple[Any, str]] = {}
    for section, keys in env_layer.items():
        for key, pair in keys.items():
            out[f"{section}.{key}"] = pair
    return out


def load_named(name: str) -> RunConfig:
    """A shipped config (``tiny``, ``m7c-125m``) with defaults for everything it leaves out."""
    path = find_config(name)
    tree = read_yaml(path)
    _check_keys(tree, f"config {path.name}")
    return validate_run_config(tree)
