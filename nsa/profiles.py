"""Hardware profiles (``profiles/*.yaml``). Interim version: the operator-CLI work completes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nsa.config import read_yaml
from nsa.errors import ConfigError

PROFILE_DIRS = [Path(__file__).resolve().parent.parent / "profiles", Path(__file__).parent / "_profiles"]


class Profile:
    def __init__(self, name: str, data: dict[str, Any]) -> None:
        self.name = name
        self.data = data

    def config_overlay(self) -> dict[str, Any]:
        return {k: v for k, v in self.data.items() if k in ("model", "nsa", "runtime", "train", "data")}


def load_profile(name_or_path: str) -> Profile:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return Profile(p.stem, read_yaml(p, "profile"))
    for d in PROFILE_DIRS:
        f = d / f"{name_or_path}.yaml"
        if f.is_file():
            return Profile(name_or_path, read_yaml(f, "profile"))
    raise ConfigError(f"profile '{name_or_path}' not found")
