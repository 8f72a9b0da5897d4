"""The run configs shipped with ``nsa`` (``--config NAME``): the YAML files of this folder.

A leaf (only ``pathlib``), so that the CLI's help can name them without loading pydantic; the rest of the
toolkit reaches the same function as ``nsa.config.named_configs``.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent


def named_configs() -> list[str]:
    """Names of the configs shipped with the package (``--config NAME``), sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
