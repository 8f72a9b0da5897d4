"""What a run writes about itself: heartbeats, CSV logs, TensorBoard, env.json and metrics.json.

The records' fields are the run directory's vocabulary (:mod:`nsa.rundir.records`); these are the writers.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

from nsa.envinfo import git_info, gpu_info, library_versions
from nsa.fileio import json_safe, named, write_atomic
from nsa.rundir.env import recorded_environment, redact_env
from nsa.rundir.records import ENV_SCHEMA, EVENT_FIELDS, HEARTBEAT_SCHEMA, Env


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON atomically (``nsa.fileio.write_atomic``): on any error ``path`` keeps its content."""
    text = json.dumps(json_safe(data), indent=2, default=str) + "\n"
    write_atomic(path, lambda tmp: tmp.write_text(text))


class LineFile:
    """An append-only text file written a whole line at a time: a write that fails part-way (a full
    disk) is cut back to the previous end, so readers never see a torn line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, text: str) -> None:
        assert self._fd is not None, f"{self.path} is closed"
        data = text.encode()
        end = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)
            if isinstance(exc, OSError):
                named(exc, self.path)
            raise

    def close(self, sync: bool = False) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if sync:
                    os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None


class Heartbeat:
    """``heartbeat_rank{r}.jsonl``: one JSON object per line, appended whole per event."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = Path(path)
        self.rank = rank
        self._f = LineFile(self.path)

    def emit(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        expected = EVENT_FIELDS[event]
        if set(fields) != set(expected):
            raise ValueError(f"heartbeat '{event}' fields {sorted(fields)} != schema {sorted(expected)}")
        record = {
            "schema": HEARTBEAT_SCHEMA, "event": event, "ts": time.time(), "rank": self.rank,
            "pid": os.getpid(), "step": step, **fields,
        }
        self._f.append(json.dumps(json_safe(record)) + "\n")
        return record

    def close(self) -> None:
        self._f.close(sync=True)


class CsvLog:
    """A CSV file with a header, one whole row per write. On resume, rows after the resumed step are
    dropped first."""

    def __init__(self, path: Path, header: tuple[str, ...], keep_until_step: int | None = None) -> None:
        self.path = Path(path)
        self.header = header
        if self.path.exists() and keep_until_step is not None:
            self._truncate(keep_until_step)
        elif self.path.exists():
            self.path.unlink()
        new = not self.path.exists()
        self._f = LineFile(self.path)
        if new:
            self._f.append(_csv_line(header))

    def _truncate(self, step: int) -> None:
        """Keep the rows up to ``step``, rewritten under this header (a run resumed by a newer version
        may have more columns: the old rows get empty cells there)."""
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))
        old = rows[0] if rows else list(self.header)
        kept = [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]
        if list(old) != list(self.header):
            kept = [[dict(zip(old, r, strict=False)).get(k, "") for k in self.header] for r in kept]
        with open(self.path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(self.header)
            w.writerows(kept)

    def row(self, values: dict[str, Any]) -> None:
        self._f.append(_csv_line([_fmt(values.get(k)) for k in self.header]))

    def close(self) -> None:
        self._f.close()


def _csv_line(cells: Any) -> str:
    buf = io.StringIO()
    csv.writer(buf).writerow(cells)
    return buf.getvalue()


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    return str(v)


class TensorBoard:
    """Scalars under ``folder`` (the run's ``tb/``; rank 0). Rows after a resumed step are purged by
    TensorBoard itself."""

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=str(folder), purge_step=purge_step)

    def scalars(self, values: dict[str, Any], step: int) -> None:
        for name, v in values.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                self._w.add_scalar(name, v, step)

    def close(self) -> None:
        self._w.flush()
        self._w.close()


# ------------------------------------------------------------------------------------------------
# env.json


def environment_record(
    *, device: str, device_name: str, precision: str, world_size: int, backend: str | None,
    profile: str | None, config_path: str | None, nsa_settings: dict[str, Any], unknown_nsa: list[str],
) -> Env:
    """The content of ``env.json`` (versions, device, driver, git, settings)."""
    gpus = gpu_info()
    return {
        "schema": ENV_SCHEMA,
        "time": time.time(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "versions": library_versions(),
        "device": device,
        "device_name": device_name,
        "precision": precision,
        "world_size": world_size,
        "backend": backend,
        "driver": gpus["driver"],
        "gpus": gpus["gpus"],
        "git": git_info(),
        "profile": profile,
        "config_path": config_path,
        "nsa_settings": redact_env({k: str(v) for k, v in nsa_settings.items()}),
        "nsa_unknown_variables": unknown_nsa,
        "environment": recorded_environment(),
    }


# ------------------------------------------------------------------------------------------------
# MFU

# Dense bf16 tensor-core peak per device, FLOP/s (vendor datasheets, no sparsity).
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}

MFU_FORMULA = "mfu = tokens_per_s * flops_per_token(seq_len) / (world_size * peak_flops_per_device)"


def peak_flops(device_name: str, override_tflops: float | None) -> tuple[float | None, str]:
    """Per-device peak FLOP/s assumed for MFU, and where it came from (``None`` when unknown)."""
    if override_tflops is not None:
        return override_tflops * 1e12, "logging.mfu_peak_tflops"
    for key, value in PEAK_BF16_FLOPS.items():
        if key.lower() in device_name.lower():
            return value, f"bf16 dense datasheet peak for '{key}'"
    return None, f"no known peak for '{device_name}' (set logging.mfu_peak_tflops)"
