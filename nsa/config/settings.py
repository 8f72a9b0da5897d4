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


# Knobs of the older system (../shared/seed-runbooks) -> what replaced them (docs/migrating.md).
LEGACY_VARS: dict[str, str] = {
    "NSA_USE_FA2": "replaced by NSA_WINDOW_BACKEND=flash|triton|flex|torch (runtime.window_backend)",
    "NSA_USE_FA2_WIN": "replaced by NSA_WINDOW_BACKEND (runtime.window_backend)",
    "NSA_USE_FA2_CMP": "gone: the compressed branch has its own kernel on every backend",
    "NSA_FA2_MIN_LEN_WIN": "gone: the dispatcher picks the window path per call",
    "NSA_FA2_MIN_LEN_CMP": "gone: the compressed branch has its own kernel on every backend",
    "NSA_SDPA_NO_FLASH": "gone: dense attention uses torch's SDPA backend choice",
    "NSA_SEL_RANGES_V2": "replaced by NSA_ATTN_BACKEND=triton|torch|reference (one dispatcher, same result on every path)",
    "NSA_SEL_RANGES_V2_MIN_S": "gone: the dispatcher picks the selection path per call",
    "NSA_USE_SEL_PACK": "replaced by NSA_ATTN_BACKEND (runtime.attn_backend)",
    "NSA_USE_SEL_VARLEN": "replaced by NSA_ATTN_BACKEND (runtime.attn_backend)",
    "NSA_USE_SEL_MASK": "replaced by NSA_ATTN_BACKEND=torch (the masked vectorised path)",
    "NSA_FORCE_SEL_MASK": "replaced by NSA_ATTN_BACKEND=torch (the masked vectorised path)",
    "NSA_USE_TRITON_SEL": "replaced by NSA_ATTN_BACKEND=triton (or torch to avoid Triton)",
    "NSA_FORCE_PARITY": "replaced by NSA_ATTN_BACKEND=reference (the float64-exact reference)",
    "NSA_PREFILL_BATCHED": "gone: prefill is always one batched pass (nsa.model.cache)",
    "NSA_PREFILL_TILE": "gone: prefill is always one batched pass (nsa.model.cache)",
    "NSA_FWE_Q": "replaced by NSA_PREFETCH_DEPTH (data.prefetch_depth)",
    "NSA_FWE_PREFETCH": "replaced by NSA_PREFETCH_DEPTH (0 turns prefetch off)",
    "NSA_FWE_DOC_BATCH": "gone: the loader streams documents; tune NSA_PREFETCH_DEPTH",
    "NSA_FWE_WARMUP_BATCHES": "gone: the first batch is prefetched during set-up and its time reported",
    "NSA_FWE_WARMUP_TIMEOUT": "replaced by NSA_LOADER_TIMEOUT (data.timeout_s)",
    "NSA_SDPA_AUDIT": "gone: nsa smoke checks every fast path against the reference",
    "NSA_DEBUG_COMPARE": "gone: nsa smoke checks every fast path against the reference",
    "NSA_DEBUG_TIMING": "replaced by nsa bench attention|train and the heartbeat's step/fetch times",
    "NSA_STRICT_ASSERTS": "gone: the spec's checks run in the test suite and nsa smoke, not at train time",
    "NSA_ENV_STATIC": "gone: settings are read once at start and recorded in env.json",
    "NSA_ROPE_SCALE": "gone: set model.rope_theta instead",
}


def describe_unknown(name: str) -> str:
    """An unknown ``NSA_*`` name with what replaced it (older system's knob) or the closest known name."""
    import difflib

    upper = name.upper()
    if upper in LEGACY_VARS:
        return f"{name} (older system: {LEGACY_VARS[upper]})"
    close = difflib.get_close_matches(upper, sorted(KNOWN), n=1)
    return f"{name} (did you mean {close[0]}?)" if close else name


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
