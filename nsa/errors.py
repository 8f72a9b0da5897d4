"""User-facing errors: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class NSAError(Exception):
    """A mistake the user can fix (bad config, missing file, unreachable data)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = self.message.replace("\n", " ")
        return f"{text} (hint: {self.hint})" if self.hint else text


class ConfigError(NSAError):
    """Invalid configuration value, unknown key or impossible combination."""


class DataError(NSAError):
    """Dataset or tokenizer cannot be used (unreachable, empty, unparsable)."""


class RunDirError(NSAError):
    """A path that should be a run directory is not one."""


class CheckpointError(NSAError):
    """No usable checkpoint, or a checkpoint that does not match the run."""
