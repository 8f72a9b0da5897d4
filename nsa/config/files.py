"""Reading config files and describing validation errors (shared by run configs and profiles)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from nsa.errors import ConfigError


def read_yaml(path: Path, what: str = "config") -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{what} {path}{where} is not valid YAML", hint="fix the YAML syntax") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"{what} {path}: {str(exc).split(';')[0]}", hint="give a shorter value") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of sections (model, nsa, runtime, train, data, "
                          "monitor)")
    return data


def format_validation_error(exc: ValidationError, sources: dict[str, str] | None = None) -> str:
    """One line per problem: the dotted field, the rule, and where the value came from."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        origin = f" (from {sources[loc]})" if sources and loc in sources else ""
        if loc and not msg.startswith(loc.split(".")[0] + "."):
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f"={shorten(got)}"
            lines.append(f"{loc}{shown}: {msg}{origin}")
        else:
            lines.append(f"{msg}{origin}")
    return "; ".join(lines)


def shorten(value: Any, width: int = 60) -> str:
    """``repr(value)``, cut to about ``width`` characters with the full length said (an over-long value
    stays one readable line)."""
    text = repr(value)
    if len(text) <= width:
        return text
    size = len(value) if isinstance(value, str) else len(str(value))
    return f"{text[:width - 3]}... ({size:,} characters)"
