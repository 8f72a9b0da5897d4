"""The pydantic base of every run-config section (a leaf module: the sections import it)."""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError


def exposed(*, env: str | None = None, flag: str | None = None) -> dict[str, Any]:
    """Field metadata (``json_schema_extra``) naming the ``NSA_*`` variable and the ``nsa train`` flag that
    set this key: ``Field(1000, json_schema_extra=exposed(env="NSA_STEPS", flag="--steps"))``. The settings
    map (:mod:`nsa.config.settings`) and the CLI's flag map are derived from it (:mod:`nsa.config.fields`)."""
    out: dict[str, Any] = {}
    if env is not None:
        out["env"] = env
    if flag is not None:
        out["flag"] = flag
    return out


def exposed_as(info: FieldInfo, what: str) -> str | None:
    """The ``env`` or ``flag`` of a field declared with :func:`exposed` (None when it has none)."""
    extra = info.json_schema_extra
    value = extra.get(what) if isinstance(extra, dict) else None
    return value if isinstance(value, str) else None


def numeric_kind(annotation: Any) -> str | None:
    """``"integer"`` or ``"number"`` when the annotation holds an int or float (also inside
    ``X | None``, ``Annotated`` and tuples), else ``None``."""
    if annotation is int:
        return "integer"
    if annotation is float:
        return "number"
    if get_origin(annotation) is Annotated:  # int with constraints, e.g. inside ``int | Literal["auto"]``
        return numeric_kind(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType, tuple, list):
        kinds = {numeric_kind(a) for a in get_args(annotation) if a is not Ellipsis}
        return "number" if "number" in kinds else "integer" if "integer" in kinds else None
    return None


def reject_bool(value: Any, annotation: Any) -> Any:
    """``value`` unchanged, or a validation error when a boolean stands for an int/float (pydantic's lax
    mode would read ``True`` as 1)."""
    kind = numeric_kind(annotation)
    if kind is None:
        return value
    items = value if isinstance(value, list | tuple) else [value]
    if any(isinstance(v, bool) for v in items):
        raise PydanticCustomError("bool_not_number", "Input should be a valid {kind}, not a boolean",
                                  {"kind": kind})
    return value


PATH_MAX, NAME_MAX = 4096, 255  # Linux's limits: bytes of a path, and of each name in it


def check_path(value: str | None) -> str | None:
    """``value`` unchanged when a filesystem can take it as a path, else a ``ValueError`` (pydantic reports
    it as the field's one line) instead of ``File name too long`` from the first call that touches it."""
    if value is None:
        return value
    size = len(value.encode("utf-8", "surrogateescape"))
    if size > PATH_MAX:
        raise ValueError(f"a path of {size:,} bytes; paths hold at most {PATH_MAX:,}")
    longest = max((len(part.encode("utf-8", "surrogateescape")) for part in value.split("/")), default=0)
    if longest > NAME_MAX:
        raise ValueError(f"a name of {longest:,} bytes in the path; names hold at most {NAME_MAX}")
    return value


class ConfigSection(BaseModel):
    """Base of the run-config sections: unknown keys rejected, assignments validated, no boolean accepted for
    an int/float field, and no infinite or NaN float."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        return value if field is None else reject_bool(value, field.annotation)
