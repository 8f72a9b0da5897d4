"""Run configuration: one pydantic section per component, the ``NSA_*`` settings and hardware profiles.

Layer rule: this package imports nothing of ``nsa`` above it (only ``nsa.errors``, ``nsa.fileio``,
``nsa.params`` and the list of shipped configs, ``nsa.configs``), so the model, ops callers, trainer, run
readers and CLI can all depend on it.

- :mod:`nsa.config.section`: the strict base class of every section (no bools for numbers).
- :mod:`nsa.config.run`: ``ModelConfig``, ``NSAConfig``, ``RuntimeConfig``, ``RunConfig``;
  :mod:`nsa.config.resolve`: layering them (defaults < config < profile < ``NSA_*`` < flags < ``--set``)
  with the origin of each value; :mod:`nsa.config.files`: reading YAML, describing validation errors.
- :mod:`nsa.config.train` (``train``, ``optimizer``, ``schedule``, ``checkpoint``, ``logging``, ``eval``),
  :mod:`nsa.config.data`, :mod:`nsa.config.monitor`: the trainer's, the data loaders' and the watch/report
  sections.
- :mod:`nsa.config.fields`: every field by dotted key, and the ``NSA_*`` and flag maps derived from its
  metadata; :mod:`nsa.config.settings`: every ``NSA_*`` variable as a field; :mod:`nsa.config.profiles`:
  hardware profiles (``profiles/*.yaml``); :mod:`nsa.config.legacy`: keys and variables of earlier versions.
"""

from __future__ import annotations

from nsa.config.data import DataConfig
from nsa.config.fields import config_fields, env_keys, flag_keys, key_flags
from nsa.config.files import format_validation_error, read_yaml
from nsa.config.monitor import MonitorConfig
from nsa.config.resolve import (
    LEGACY_DEFAULTS,
    ResolvedConfig,
    fill_legacy,
    find_config,
    leaves,
    load_named,
    load_run_config,
    named_configs,
    parse_set,
    saved_run_config,
    validate_run_config,
)
from nsa.config.run import CONFIG_DIR, GATE_PRESETS, ModelConfig, NSAConfig, RunConfig, RuntimeConfig
from nsa.config.section import ConfigSection
from nsa.config.train import (
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    OptimizerConfig,
    ScheduleConfig,
    ScorerConfig,
    TrainConfig,
)

__all__ = [
    "CONFIG_DIR",
    "GATE_PRESETS",
    "LEGACY_DEFAULTS",
    "CheckpointConfig",
    "ConfigSection",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "MonitorConfig",
    "NSAConfig",
    "OptimizerConfig",
    "ResolvedConfig",
    "RunConfig",
    "RuntimeConfig",
    "ScheduleConfig",
    "ScorerConfig",
    "TrainConfig",
    "config_fields",
    "env_keys",
    "fill_legacy",
    "find_config",
    "flag_keys",
    "format_validation_error",
    "key_flags",
    "leaves",
    "load_named",
    "load_run_config",
    "named_configs",
    "parse_set",
    "read_yaml",
    "saved_run_config",
    "validate_run_config",
]
