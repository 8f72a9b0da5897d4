"""Validated configuration: model, NSA, runtime, train and data sections, and their resolution.

Precedence, lowest to highest: defaults < config YAML < hardware profile < ``NSA_*`` environment <
command-line flags and ``--set section.key=value``. ``load_run_config`` records where each value came
from so that ``nsa profiles show`` and the run directory can say it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from nsa.config.data import DataConfig
from nsa.config.monitor import MonitorConfig
from nsa.config.section import ConfigSection
from nsa.config.train import TrainConfig
from nsa.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class _Section(ConfigSection):
    """A run-config section (see ``ConfigSection``: no booleans for int/float fields)."""


class ModelConfig(_Section):
    """LLaMA-style decoder: embedding, ``n_layers`` blocks (RMSNorm, attention, SwiGLU), norm, head."""

    vocab_size: int = Field(256, ge=2)
    dim: int = Field(768, ge=8)
    n_layers: int = Field(12, ge=1)
    n_heads: int = Field(12, ge=1)
    n_kv_groups: int = Field(2, ge=1)
    d_k: int = Field(64, ge=4)
    d_v: int = Field(64, ge=4)
    mlp_hidden: int | None = Field(None, ge=8, description="SwiGLU hidden size; default 4 * dim")
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    max_seq_len: int = Field(65536, ge=1)
    attention: Literal["nsa", "dense"] = "nsa"
    tie_embeddings: bool = False
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.n_heads % self.n_kv_groups:
            raise ValueError(
                f"model.n_kv_groups={self.n_kv_groups} must divide model.n_heads={self.n_heads}"
            )
        if self.d_k % 2:
            raise ValueError(f"model.d_k={self.d_k} must be even (RoPE rotates pairs)")
        return self

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.n_kv_groups

    @property
    def ffn_hidden(self) -> int:
        return self.mlp_hidden or 4 * self.dim


class NSAConfig(_Section):
    """NSA hyper-parameters (paper defaults) and module options."""

    l: int = Field(32, ge=1, description="compression block length")  # noqa: E741
    d: int = Field(16, ge=1, description="compression stride")
    l_sel: int = Field(64, ge=1, description="selection block length (paper l')")
    n_sel: int = Field(16, ge=1, description="selected blocks per query, forced blocks included")
    w: int = Field(512, ge=1, description="sliding window")
    phi: Literal["avg", "mlp"] = "avg"
    gate: Literal["sigmoid", "softmax"] = "sigmoid"
    shared_kv: bool = False
    gate_hidden: int | None = Field(None, ge=1, description="gate MLP hidden size; default dim // 4")
    gate_bias: tuple[float, float, float] = Field(
        (-2.0, -2.0, -2.0), description="constant gate logits (cmp, sel, win): logits = gate_bias + gate_scale * mlp(x)"
    )
    gate_scale: float = Field(
        0.1, gt=0, le=1, description="multiplier on the learned gate MLP (slows the gates under Adam)"
    )
    fixed_gates: tuple[float, float, float] | None = Field(
        None, description="constant gates (cmp, sel, win) instead of the gate MLP, for ablations"
    )
    collapse_threshold: float = Field(0.9, gt=0, le=1, description="share above which a gate counts as collapsed")

    @model_validator(mode="after")
    def _check(self) -> NSAConfig:
        if self.l % self.d:
            raise ValueError(f"nsa.d={self.d} must divide nsa.l={self.l}")
        if self.l_sel % self.d:
            raise ValueError(f"nsa.d={self.d} must divide nsa.l_sel={self.l_sel}")
        if self.l_sel < self.d:
            raise ValueError(f"nsa.l_sel={self.l_sel} must be >= nsa.d={self.d}")
        return self

    def op_kwargs(self) -> dict[str, int]:
        """The keyword arguments of the ``nsa.ops`` calls."""
        return {"l": self.l, "d": self.d, "l_sel": self.l_sel, "n_sel": self.n_sel, "w": self.w}


class RuntimeConfig(_Section):
    """Where and how the math runs."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    attn_backend: Literal["auto", "reference", "torch", "triton"] = "auto"
    window_backend: Literal["auto", "triton", "flex", "flash", "torch"] = "auto"
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the model; auto: on CUDA (where it is faster), not on CPU")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode; reduce-overhead replays each step as CUDA graphs")
    gradient_checkpointing: bool = False
    deterministic: bool = False
    tf32: bool = True
    alloc_conf: str | None = Field(None, description="PYTORCH_CUDA_ALLOC_CONF for the run")


class RunConfig(_Section):
    """Everything a run needs; saved as ``config.yaml`` in the run directory."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    nsa: NSAConfig = Field(default_factory=NSAConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# --------------------------------------------------------------------------------------------------
# Resolution


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


def read_yaml(path: Path, what: str = "config") -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{what} {path}{where} is not valid YAML", hint="fix the YAML syntax") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of sections (model, nsa, runtime, train, data, monitor)")
    return data


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


def format_validation_error(exc: ValidationError, sources: dict[str, str] | None = None) -> str:
    """One line per problem: the dotted field, the rule, and where the value came from."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        origin = f" (from {sources[loc]})" if sources and loc in sources else ""
        if loc and not msg.startswith(loc.split(".")[0] + "."):
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f"={got!r}"
            lines.append(f"{loc}{shown}: {msg}{origin}")
        else:
            lines.append(f"{msg}{origin}")
    return "; ".join(lines)


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
    from nsa.config.profiles import load_profile
    from nsa.config.settings import env_overlay

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
