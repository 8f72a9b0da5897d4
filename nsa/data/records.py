"""Checking raw records: bad ones are skipped and counted by reason, never raised."""

from __future__ import annotations

from dataclasses import dataclass

# skip reasons, as they appear in ``Loader.stats()["skipped"]``
EMPTY = "empty"
MISSING = "missing_field"
NOT_STR = "not_str"
INVALID_UTF8 = "invalid_utf8"
TOO_LONG = "too_long"
MALFORMED = "malformed"
REASONS = (EMPTY, MISSING, NOT_STR, INVALID_UTF8, TOO_LONG, MALFORMED)


@dataclass(frozen=True)
class Malformed:
    """A record that could not be parsed (e.g. a line of a JSONL file that is not a JSON object).

    Sources yield it in the record's place, so document indices stay stable; it is skipped as ``malformed``.
    """

    file: str
    line: int  # 1-based line in ``file``
    error: str

    def where(self) -> str:
        """``<file> line <n>: <error>``, for messages."""
        return f"{self.file} line {self.line}: {self.error}"


def clean_text(value: object, max_doc_chars: int) -> tuple[str | None, str | None]:
    """``(text, None)`` for a usable document, else ``(None, reason)``.

    ``bytes`` are decoded as strict UTF-8; strings holding lone surrogates or U+FFFD (what a
    ``errors="replace"`` decode leaves behind) count as invalid UTF-8; a :class:`Malformed` record is
    ``malformed``.
    """
    if isinstance(value, Malformed):
        return None, MALFORMED
    if value is None:
        return None, MISSING
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None, INVALID_UTF8
    if not isinstance(value, str):
        return None, NOT_STR
    if not value.strip():
        return None, EMPTY
    if len(value) > max_doc_chars:
        return None, TOO_LONG
    if "\ufffd" in value:
        return None, INVALID_UTF8
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None, INVALID_UTF8
    return value, None
