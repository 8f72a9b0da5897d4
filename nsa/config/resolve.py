"""Resolving a run's config: defaults < config YAML < profile < ``NSA_*`` environment < flags < ``--set``,
with the origin of every value, and reading saved configs (older runs' defaults filled in)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from nsa.config.fields import key_flags
from nsa.config.files import format_validation_error, read_yaml, shorten
from nsa.config.legacy import CONFIG_VAR, translate_old_keys
from nsa.config.profiles import load_profile
from nsa.config.run import CONFIG_DIR, RunConfig
from nsa.config.settings import config_from_env, describe_unknown_env, env_overlay
from nsa.configs import named_configs as named_configs  # the one list of shipped configs (a torch-free leaf)
from nsa.errors import ConfigError


@dataclass
class ResolvedConfig:
    """A validated ``RunConfig`` with the origin of every value."""

    config: RunConfig
    sources: dict[str, str] = field(default_factory=dict)
    unknown_env: list[str] = field(default_factory=list)
    profile: str | None = None
    config_path: str | None = None
    # inputs of the older system that were mapped (one line each)
    notes: list[str] = field(default_factory=list)
    unknown_env_described: list[str] = field(default_factory=list)  # unknown NSA_* names with value and hint

    def source_of(self, dotted: str) -> str:
        return self.sources.get(dotted, "default")


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
    """Reject unknown sections/keys with the dotted name and where it came from: every unknown one in one
    message (a file ported from elsewhere is fixed in one pass, not one key per attempt)."""
    sections = RunConfig.model_fields
    bad_sections: list[str] = []
    bad_keys: dict[str, list[str]] = {}
    for dotted in leaves(tree):
        parts = dotted.split(".")
        if parts[0] not in sections:
            if parts[0] not in bad_sections:
                bad_sections.append(parts[0])
            continue
        fields = getattr(sections[parts[0]].annotation, "model_fields", {})
        if len(parts) < 2 or parts[1] not in fields:
            bad_keys.setdefault(parts[0], []).append(".".join(parts[:2]))
    if not bad_sections and not bad_keys:
        return
    what = [f"unknown section '{s}'" for s in bad_sections]
    what += [f"unknown key '{k}'" for keys in bad_keys.values() for k in keys]
    if bad_sections:
        hint = f"sections are: {', '.join(sections)}"
    else:
        hint = "; ".join(f"keys of {sec}: {', '.join(getattr(sections[sec].annotation, 'model_fields', {}))}"
                         for sec in bad_keys)
    raise ConfigError(f"{', '.join(what)} ({origin})", hint=hint)


def parse_set(item: str) -> tuple[str, Any]:
    """``section.key=value`` with the value read as YAML (so numbers and booleans are typed)."""
    if "=" not in item:
        raise ConfigError(f"--set '{item}' must look like section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if key.count(".") != 1:
        raise ConfigError(f"--set '{item}': key must be section.key (e.g. optimizer.lr=3e-4)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"--set {key}={shorten(raw.strip())}: {str(exc).split(';')[0]}",
                          hint="give a shorter value") from None
    return key, value


# Fields added after runs were first saved, with the values that rebuild those runs' models exactly
# (today's defaults differ: see docs/design.md, "Gates").
LEGACY_DEFAULTS: dict[str, Any] = {"nsa.gate_bias": [0.0, 0.0, 0.0], "nsa.gate_scale": 1.0,
                                   "nsa.window_query": False, "nsa.kv_speed": 1.0}


# Keys that only name another key's value (not saved with a run: the value is): `nsa.gate_init` ->
# `nsa.gate_bias`.
NAMES_OF: dict[str, str] = {"nsa.gate_init": "nsa.gate_bias"}


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
    """Validate a config saved by a run (see ``fill_legacy``); keys of earlier versions are mapped silently
    (``train.lr`` -> ``optimizer.lr``) and those that went away dropped (``nsa.config.legacy``)."""
    mapped, _ = translate_old_keys(tree, "saved config", saved=True)
    return validate_run_config(fill_legacy(mapped))


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
    flag_names: dict[str, str] | None = None,
) -> ResolvedConfig:
    """Resolve a run config from its sources (see module docstring for precedence).

    ``flag_names`` maps a dotted key of ``flags`` to the flag the user typed (``data.source`` ->
    ``--dataset``, ``runtime.compile`` -> ``--no-compile``), for the origin of each value (``flag
    --dataset``); a name that is not a flag is the origin itself (``profile cpu smoke.steps``); without one,
    the key's flag from the config's metadata. Without ``config``, the older system's ``CONFIG=path`` variable
    is read in its place; keys of earlier versions (the older system's YAML keys, ``train.lr`` before the
    sections split) are mapped in the config file, ``flags`` and ``--set`` (``nsa.config.legacy``); each with
    a line in ``ResolvedConfig.notes``."""

    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []

    def apply(layer: dict[str, Any], origin: str, translate: bool = False) -> None:
        if translate:  # keys of earlier versions, one note each (the config file is translated as it is read)
            layer, changed = translate_old_keys(layer, origin)
            notes.extend(changed)
        _check_keys(layer, origin)
        for dotted, value in leaves(layer).items():
            _set_dotted(tree, dotted, copy.deepcopy(value))
            sources[dotted] = origin

    config_path = None
    config, note, from_env = _config_or_env(config, environ)
    notes += [note] if note else []
    if config is not None:
        path = _find_env_config(config) if from_env else find_config(config)
        config_path = str(path)
        layer, mapped = translate_old_keys(read_yaml(path), f"config {path.name}")
        notes += mapped
        apply(layer, f"config {path.name}")
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
            apply(_nest(dotted, value), _flag_origin(dotted, flag_names), translate=True)
    for item in sets or []:
        dotted, value = parse_set(item)
        apply(_nest(dotted, value), f"--set {dotted}", translate=True)
    cfg = validate_run_config(tree, sources)
    for name, target in NAMES_OF.items():  # the named value comes from where its name was set
        if name in sources and target not in sources:
            sources[target] = f"{sources[name]} ({name})"
    return ResolvedConfig(cfg, sources, unknown, profile_name, config_path, notes,
                          describe_unknown_env(environ))


def default_config_note(resolved: ResolvedConfig) -> str | None:
    """A line for a run resolved without any config file (no ``--config``, no ``CONFIG``): which model and
    data the defaults train, so ``nsa train --steps 50000`` does not start the wrong run silently."""
    if resolved.config_path is not None:
        return None
    cfg = resolved.config
    m, d = cfg.model, cfg.data
    data = ("the small corpus shipped with nsa (Python stdlib docstrings, 1.3M characters)" if d.source
            == "embedded"
            else f"data.source={d.source}")
    return (f"no --config given: the default model (dim {m.dim} x {m.n_layers} layers, {m.n_heads} heads, "
            f"{m.attention}) trains on {data}; pass --config {', '.join(named_configs())} or a YAML path for "
            "another")


def _config_or_env(config: str | Path | None, environ: dict[str, str] | None) -> tuple[str | Path | None,
                                                                                       str | None, bool]:
    """``(config, note, from_env)``: ``config``, or the older system's ``CONFIG`` variable in its place (a
    note says so), or a note that ``CONFIG`` was ignored because ``--config`` was given."""
    env = config_from_env(environ)
    if env is None:
        return config, None, False
    if config is None:
        return (env, f"config from {CONFIG_VAR}={env} (the older system's variable; --config is the flag)",
                True)
    if str(env) != str(config):
        return config, f"{CONFIG_VAR}={env} ignored: --config {config} given", False
    return config, None, False


def _find_env_config(name: str | Path) -> Path:
    try:
        return find_config(name)
    except ConfigError as exc:
        raise ConfigError(f"{CONFIG_VAR}={name} (the older system's variable, read as --config): "
                          f"{exc.message}", hint=f"pass --config NAME|PATH, or unset {CONFIG_VAR}") from None


def _flag_origin(dotted: str, flag_names: dict[str, str] | None) -> str:
    """``flag --dataset`` for ``data.source``: the name the caller gives (a flag, or a whole origin such as
    ``profile cpu smoke.steps``), else the key's flag in the config's metadata, else one made of the key."""
    name = (flag_names
            or {}).get(dotted) or key_flags().get(dotted) or f"--{dotted.split('.')[-1].replace('_', '-')}"
    return f"flag {name}" if name.startswith("-") else name


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
    tree, _ = translate_old_keys(read_yaml(path), f"config {path.name}")
    _check_keys(tree, f"config {path.name}")
    return validate_run_config(tree)
