"""Incremental, fault-tolerant reading of a run directory (see ``docs/run-directory.md``).

``RunReader(run_dir).poll()`` reads only what was appended since the last poll, keeps a truncated last
line until it is completed, counts corrupt lines instead of failing, and tolerates missing files. It
works for multi-rank runs (one ``heartbeat_rank{r}.jsonl`` per rank).

Size: the incremental tail readers (JSONL, CSV) and the run state they fill, tested as one unit.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nsa.config.monitor import MonitorConfig
from nsa.errors import RunDirError
from nsa.rundir import RunDir
from nsa.rundir.layout import (
    CONFIG_FILE,
    ENV_FILE,
    HALT_FILE,
    HEARTBEAT,
    HEARTBEAT_RE,
    LOCK_FILE,
    METRICS_FILE,
    TRAIN_CSV,
    is_run_dir,
    read_halt,
    read_lock,
)
from nsa.rundir.records import (
    ENV_SCHEMA,
    HEARTBEAT_SCHEMA,
    METRICS_SCHEMA,
    AnomalyEvent,
    BootEvent,
    CheckpointEvent,
    EndEvent,
    Env,
    EvalEvent,
    Event,
    HaltEvent,
    HaltFile,
    LoaderReadyEvent,
    Metrics,
    ProgressEvent,
    TrainRow,
    ValRow,
    newer_schema,
    schema_note,
)

MAX_HISTORY = 20000  # progress points kept in memory (older ones are thinned)
DEFAULT_STALE_S = float(MonitorConfig.model_fields["stale_s"].default)  # a run's own monitor.stale_s wins
# a data source replaced by synthetic tokens says so in its warning (nsa.data.sources.open_source)
FALLBACK_RE = re.compile(r"TRAINING ON SYNTHETIC|replaced by synthetic", re.I)


def may_become_run(path: str | Path) -> bool:
    """Whether waiting for a run at ``path`` makes sense: it is missing, an empty folder, or a folder
    that a starting ``nsa train`` has claimed (its ``.lock`` or ``config.yaml``) or that is a run already.
    Anything else (``/tmp``, a source tree) is not a run directory and never becomes one by waiting."""
    p = Path(path)
    if not p.exists():
        return True
    if not p.is_dir():
        return False
    try:
        names = os.listdir(p)
    except OSError:
        return False
    return not names or LOCK_FILE in names or CONFIG_FILE in names or is_run_dir(p)


def check_run_dir(path: str | Path) -> Path:
    """The path, or ``RunDirError`` saying why it is not a run directory."""
    p = Path(path)
    if not p.exists():
        raise RunDirError(f"run directory {p} does not exist",
                          hint="give the train.out_dir of a run, e.g. artifacts/tiny")
    if not p.is_dir():
        raise RunDirError(f"{p} is a file, not a run directory",
                          hint="give the folder that holds heartbeat_rank0.jsonl")
    if not is_run_dir(p):
        raise RunDirError(
            f"{p} is not a run directory (no heartbeat_rank*.jsonl, config.yaml, env.json or training.csv)",
            hint="give the train.out_dir of a run started by `nsa train`",
        )
    return p


class _Tail:
    """Whole lines appended to a file since the last call; an unfinished last line waits in ``partial``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.corrupt = 0

    def _new_lines(self) -> tuple[list[bytes], bool] | None:
        """``(lines, restarted)``; ``None`` when the file cannot be read (missing)."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return None
        restarted = size < self.offset  # rewritten from scratch
        if restarted:
            self.offset, self.partial = 0, b""
        if size == self.offset:
            return [], restarted
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return lines, restarted


class JsonlTail(_Tail):
    """Reads the JSON objects appended to a file since the last call."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.truncated = False

    def read_new(self, final: bool = False) -> list[dict[str, Any]]:
        got = self._new_lines()
        if got is None:
            return []
        out: list[dict[str, Any]] = []
        for line in got[0]:
            self._parse(line, out)
        self.truncated = bool(self.partial.strip())
        if final and self.truncated:
            # a last line without newline: accept it if it is whole, else count it as truncated
            try:
                obj = json.loads(self.partial)
            except ValueError:
                return out
            if isinstance(obj, dict):
                out.append(obj)
                self.partial, self.truncated = b"", False
        return out

    def _parse(self, line: bytes, out: list[dict[str, Any]]) -> None:
        if not line.strip():
            return
        try:
            obj = json.loads(line)
        except ValueError:
            self.corrupt += 1
            return
        if isinstance(obj, dict):
            out.append(obj)
        else:
            self.corrupt += 1


class CsvTail(_Tail):
    """Rows appended to a CSV with a header line, as dicts of floats (non-numbers kept as text)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.header: list[str] | None = None

    def read_new(self, final: bool = False) -> list[Any]:  # rows of records.TrainRow / ValRow
        got = self._new_lines()
        if got is None:
            return []
        lines, restarted = got
        if restarted:
            self.header = None
        if final and self.partial.strip():
            lines.append(self.partial)
            self.partial = b""
        out = []
        for raw in lines:
            text = raw.decode("utf-8", "replace").strip()
            if not text:
                continue
            cells = next(csv.reader(io.StringIO(text)))
            if self.header is None:
                self.header = [c.strip() for c in cells]
                continue
            if len(cells) != len(self.header):
                self.corrupt += 1
                continue
            row: dict[str, Any] = {}
            for key, cell in zip(self.header, cells, strict=True):
                row[key] = _number(cell)
            if not isinstance(row.get("step"), int | float):
                self.corrupt += 1
                continue
            out.append(row)
        return out


def _number(text: str) -> Any:
    t = text.strip()
    if t == "":
        return None
    try:
        v = float(t)
    except ValueError:
        return t
    return int(v) if v.is_integer() and "." not in t and "e" not in t.lower() and math.isfinite(v) else v


@dataclass
class RankState:
    rank: int
    boot: BootEvent | None = None
    last: Event | None = None
    last_progress: ProgressEvent | None = None
    first_progress: ProgressEvent | None = None  # the current session's first progress line
    end: EndEvent | None = None
    events: int = 0

    @property
    def last_ts(self) -> float | None:
        return float(self.last["ts"]) if self.last and isinstance(self.last.get("ts"), int | float) else None


@dataclass
class RunState:
    """Everything read so far from one run directory."""

    run_dir: Path
    files: RunDir = field(init=False)  # every path of the run directory
    ranks: dict[int, RankState] = field(default_factory=dict)
    progress: list[ProgressEvent] = field(default_factory=list)  # rank-0 progress events
    csv_rows: list[TrainRow] = field(default_factory=list)  # training.csv
    val_rows: list[ValRow] = field(default_factory=list)
    evals: list[EvalEvent] = field(default_factory=list)
    checkpoints: list[CheckpointEvent] = field(default_factory=list)
    anomalies: list[AnomalyEvent] = field(default_factory=list)
    halts: list[HaltEvent] = field(default_factory=list)
    loader_ready: LoaderReadyEvent | None = None
    config: dict[str, Any] | None = None
    # dotted key -> origin (config.yaml comments)
    config_sources: dict[str, str] = field(default_factory=dict)
    config_error: str | None = None  # why config.yaml (present) could not be read: its settings are unknown
    env: Env | None = None
    metrics: Metrics | None = None
    halt_file: HaltFile | None = None
    corrupt_lines: int = 0
    truncated_lines: int = 0
    files_missing: list[str] = field(default_factory=list)
    # files written by a newer nsa (records.newer_schema)
    schema_notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.files = RunDir(self.run_dir)

    # ---- derived views
    @property
    def rank0(self) -> RankState | None:
        return self.ranks.get(0) or (self.ranks[min(self.ranks)] if self.ranks else None)

    @property
    def boot(self) -> BootEvent | None:
        r = self.rank0
        return r.boot if r else None

    @property
    def end(self) -> EndEvent | None:
        r = self.rank0
        return r.end if r else None

    @property
    def run_name(self) -> str:
        if self.boot and self.boot.get("run_name"):
            return str(self.boot["run_name"])
        train = (self.config or {}).get("train") or {}
        return str(train.get("run_name") or self.run_dir.resolve().name)

    @property
    def world_size(self) -> int:
        if self.boot and isinstance(self.boot.get("world_size"), int):
            return int(self.boot["world_size"])
        return max(1, len(self.ranks))

    def series(self) -> Sequence[Mapping[str, Any]]:
        """Per-step points: training.csv rows if there are any, else rank-0 progress events."""
        return self.csv_rows if self.csv_rows else self.progress

    @property
    def last_progress(self) -> ProgressEvent | None:
        return self.progress[-1] if self.progress else None

    @property
    def steps_done(self) -> int:
        best = 0
        for src in (self.progress[-1:], self.csv_rows[-1:]):
            for p in src:
                if isinstance(p.get("step"), int | float):
                    best = max(best, int(p["step"]))
        r = self.rank0
        if r and r.last and isinstance(r.last.get("step"), int | float):
            best = max(best, int(r.last["step"]))
        return best

    @property
    def steps_total(self) -> int | None:
        for src in (self.last_progress, self.boot):
            if src and isinstance(src.get("steps_total"), int):
                return int(src["steps_total"])
        train = (self.config or {}).get("train") or {}
        return train.get("steps") if isinstance(train.get("steps"), int) else None

    @property
    def data_warnings(self) -> list[str]:
        """The loader's warnings (a failed source replaced by synthetic tokens, malformed records), from the
        ``loader-ready`` event, the last ``progress`` line, ``metrics.json`` and ``env.json``; each once."""
        out: list[str] = []
        sources = [(self.loader_ready or {}).get("warnings"), (self.last_progress or {}).get("data_warnings"),
                   (self.metrics or {}).get("data_warnings"), (self.env or {}).get("data_warnings")]
        for ws in sources:
            for w in ws if isinstance(ws, list) else []:
                if str(w) not in out:
                    out.append(str(w))
        return out

    @property
    def data_fallback(self) -> str | None:
        """Why the run trained on synthetic tokens instead of its configured source (None when it did not):
        the ``loader-ready`` event's ``source_used`` differs from ``source``, or a loader warning says so."""
        ready = self.loader_ready or {}
        used, wanted = ready.get("source_used"), ready.get("source")
        said = next((w for w in self.data_warnings if FALLBACK_RE.search(w)), None)
        if isinstance(used, str) and isinstance(wanted, str) and used != wanted:
            return said or f"data.source={wanted} was replaced by {used}"
        return said

    def heartbeat_age(self, now: float) -> dict[int, float]:
        """Seconds since each rank's last heartbeat line."""
        return {r: now - s.last_ts for r, s in self.ranks.items() if s.last_ts is not None}

    def process_alive(self) -> bool | None:
        """Whether rank 0's trainer process is alive (None when it runs on another host or is unknown)."""
        return pid_alive(self.boot)

    @property
    def session_start(self) -> float | None:
        """``ts`` of rank 0's latest ``boot`` (the current session of a resumed run)."""
        boot = self.boot
        return float(boot["ts"]) if boot and isinstance(boot.get("ts"), int | float) else None

    def session_progress(self) -> list[ProgressEvent]:
        """Rank-0 progress events of the current session (after the latest ``boot``)."""
        t0 = self.session_start
        if t0 is None:
            return self.progress
        return [p for p in self.progress if isinstance(p.get("ts"), int | float) and p["ts"] >= t0]

    @property
    def pending_halt(self) -> HaltFile | None:
        """The ``.HALT`` file while the trainer has not acted on it yet: ``None`` once a ``halt`` or ``end``
        event at or after the file's time (1 s of clock slack) is in the heartbeat."""
        h = self.halt_file
        if h is None:
            return None
        t = h.get("time")
        if not isinstance(t, int | float) or isinstance(t, bool):
            return h
        acted = [e for e in [*self.halts, *(r.end for r in self.ranks.values() if r.end)]
                 if isinstance(e.get("ts"), int | float) and e["ts"] >= t - 1.0]
        return None if acted else h

    def new_session_pending(self) -> bool:
        """The run ended (or its trainer is gone without an end event), but its lock is held by a live
        trainer that took it after that (a ``--resume`` is starting): its ``boot`` line is still to come."""
        last = self.end if self.end is not None else (self.boot if self.process_alive() is False else None)
        if last is None or not isinstance(last.get("ts"), int | float):
            return False
        holder = read_lock(self.run_dir)
        if not holder or not isinstance(holder.get("since"), int | float):
            return False
        if holder.get("pid") == last.get("pid") or float(holder["since"]) < float(last["ts"]) - 1.0:
            return False  # the lock is the last session's own
        return pid_alive(holder) is True

    def status(self, now: float, stale_s: float = DEFAULT_STALE_S) -> str:
        """``completed``/``halted``/``failed`` (from the end event), else ``running``, ``stale`` or
        ``crashed``."""
        ends = [s.end for s in self.ranks.values() if s.end]
        if self.end is not None or ends:
            statuses = [str(e.get("status", "failed")) for e in ([self.end] if self.end else ends)]
            for s in ("failed", "halted", "completed"):
                if s in statuses:
                    return s
            return statuses[0]
        if not self.ranks:
            if self.metrics and self.metrics.get("status"):
                return str(self.metrics["status"])
            return "not-started" if not self.csv_rows else "unknown"
        if self.process_alive() is False:
            return "crashed"
        ages = self.heartbeat_age(now)
        if ages and max(ages.values()) > stale_s:
            return "stale"
        return "running"


class RunReader:
    """Polls one run directory; each ``poll()`` reads only new data and returns the updated state."""

    def __init__(self, run_dir: str | Path, check: bool = True) -> None:
        self.run_dir = check_run_dir(run_dir) if check else Path(run_dir)
        self.state = RunState(self.run_dir)
        self.files = self.state.files
        self._hb: dict[int, JsonlTail] = {}
        self._csv = CsvTail(self.files.train_csv)
        self._val = CsvTail(self.files.val_csv)
        self._mtimes: dict[str, float] = {}
        self._bad_events = 0

    def _changed(self, name: str) -> bool:
        try:
            m = (self.run_dir / name).stat().st_mtime_ns
        except OSError:
            if name in self._mtimes:
                self._mtimes.pop(name)
                return True
            return False
        if self._mtimes.get(name) == m:
            return False
        self._mtimes[name] = m
        return True

    def _note_schema(self, name: str, record: Any, known: int) -> None:
        schema = newer_schema(record, known)
        note = schema_note(name, schema, known) if schema is not None else None
        if note is not None and note not in self.state.schema_notes:
            self.state.schema_notes.append(note)

    def _read_small(self) -> None:
        st = self.state
        if self._changed(CONFIG_FILE):
            st.config, st.config_error = None, None
            try:
                text = self.files.config.read_text()
                data = yaml.safe_load(text)
                st.config = data if isinstance(data, dict) else None
                st.config_sources = parse_sources(text)
                if st.config is None:
                    st.config_error = f"{CONFIG_FILE} is not a mapping of sections"
            except FileNotFoundError:  # a run still starting: no config yet, nothing to say
                pass
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
                why = " ".join(str(exc).split())
                st.config_error = f"{CONFIG_FILE} cannot be read: {why[:200]}"
        for path, attr, known in ((self.files.env, "env", ENV_SCHEMA),
                                  (self.files.metrics, "metrics", METRICS_SCHEMA)):
            name = path.name
            if self._changed(name):
                try:
                    data = json.loads(path.read_text())
                    setattr(st, attr, data if isinstance(data, dict) else None)
                except (OSError, ValueError):
                    setattr(st, attr, None)
                    continue
                self._note_schema(name, data, known)
        if self._changed(HALT_FILE):
            st.halt_file = halt_record(self.run_dir)
        st.files_missing = [n for n in (CONFIG_FILE, ENV_FILE, TRAIN_CSV) if not (self.run_dir / n).exists()]
        if not self._hb:
            st.files_missing.append(HEARTBEAT.format(rank=0))

    def poll(self, final: bool = False) -> RunState:
        st = self.state
        try:
            names = os.listdir(self.run_dir)
        except OSError:
            names = []
        for name in names:
            m = HEARTBEAT_RE.match(name)
            if m and int(m.group(1)) not in self._hb:
                self._hb[int(m.group(1))] = JsonlTail(self.run_dir / name)
        for rank, tail in sorted(self._hb.items()):
            for ev in tail.read_new(final=final):
                self._apply(rank, ev)
        st.csv_rows.extend(self._csv.read_new(final=final))
        st.val_rows.extend(self._val.read_new(final=final))
        st.corrupt_lines = (sum(t.corrupt for t in self._hb.values()) + self._csv.corrupt + self._val.corrupt
                            + self._bad_events)
        st.truncated_lines = sum(1 for t in self._hb.values() if t.truncated)
        if len(st.csv_rows) > MAX_HISTORY:
            st.csv_rows[:] = st.csv_rows[::2]
        self._read_small()
        return st

    def _apply(self, file_rank: int, ev: Any) -> None:  # one heartbeat line: an Event of records.EVENTS
        st = self.state
        raw_rank = ev.get("rank")
        rank = raw_rank if isinstance(raw_rank, int) else file_rank
        rs = st.ranks.setdefault(rank, RankState(rank))
        self._note_schema(HEARTBEAT.format(rank=rank), ev, HEARTBEAT_SCHEMA)
        if not isinstance(ev.get("ts"), int | float):
            self._bad_events += 1
            return
        rs.last = ev
        rs.events += 1
        kind = ev.get("event")
        if kind == "boot":
            rs.boot, rs.end, rs.first_progress = ev, None, None
        elif kind == "progress":
            rs.last_progress = ev
            rs.first_progress = rs.first_progress or ev
            if rank == 0:
                st.progress.append(ev)
                if len(st.progress) > MAX_HISTORY:
                    st.progress[:] = st.progress[::2]
        elif kind == "end":
            rs.end = ev
        elif rank == 0 and kind == "loader-ready":
            st.loader_ready = ev
        elif rank == 0 and kind == "eval":
            st.evals.append(ev)
        elif rank == 0 and kind == "checkpoint":
            st.checkpoints.append(ev)
        elif kind == "anomaly":
            st.anomalies.append(ev)
        elif kind == "halt":
            st.halts.append(ev)


SOURCE_LINE = re.compile(r"^#\s+([A-Za-z_]+\.[A-Za-z_]+):\s*(.+?)\s*$")


def parse_sources(config_text: str) -> dict[str, str]:
    """The ``# _sources`` comment block of a run's ``config.yaml``: dotted key -> where it came from."""
    out: dict[str, str] = {}
    in_block = False
    for line in config_text.splitlines():
        if line.startswith("# _sources"):
            in_block = True
            continue
        if in_block:
            m = SOURCE_LINE.match(line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def halt_record(run_dir: str | Path) -> HaltFile | None:
    """The ``.HALT`` of a run directory as the monitoring shows it (:func:`nsa.rundir.layout.read_halt`; an
    empty file's reason reads ``(empty .HALT)``), or None."""
    data = read_halt(run_dir)
    if data is not None and not data.get("reason"):
        data["reason"] = "(empty .HALT)"
    return data


def pid_alive(boot: Mapping[str, Any] | None) -> bool | None:
    """Whether the process of a ``boot`` event is alive: None when it ran on another host or is unknown;
    a zombie (killed, not yet reaped) counts as gone."""
    if not boot or not isinstance(boot.get("pid"), int) or isinstance(boot.get("pid"), bool):
        return None
    if boot.get("host") not in (None, socket.gethostname()):
        return None
    try:
        import psutil

        pid = int(boot["pid"])
        if not psutil.pid_exists(pid):
            return False
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:
            return True
    except Exception:
        return None


def run_started(path: str | Path) -> bool:
    """Whether ``path`` is a run directory with something to show: a non-empty heartbeat file, or
    ``metrics.json`` / ``training.csv`` of a run that wrote no heartbeat."""
    p = Path(path)
    try:
        names = os.listdir(p)
    except OSError:
        return False
    for name in names:
        if HEARTBEAT_RE.match(name):
            with contextlib.suppress(OSError):
                if (p / name).stat().st_size > 0:
                    return True
    return METRICS_FILE in names or TRAIN_CSV in names


def wait_for_run(path: str | Path, timeout_s: float | None = None, poll_s: float = 0.5) -> bool:
    """Wait until ``run_started(path)`` (True) or ``timeout_s`` passes (False); ``RunDirError`` at once
    when the path is a file or a folder that is not a run directory (:func:`may_become_run`)."""
    p = Path(path)
    t0 = time.monotonic()
    while True:
        if not run_started(p) and not may_become_run(p):
            check_run_dir(p)
            raise RunDirError(f"{p} is not a run directory (no heartbeat, config.yaml or .lock)",
                              hint="give the train.out_dir of a run started by `nsa train`")
        if run_started(p):
            return True
        if timeout_s is not None and time.monotonic() - t0 >= timeout_s:
            return False
        time.sleep(poll_s if timeout_s is None
                   else max(0.0, min(poll_s, timeout_s - (time.monotonic() - t0))))


def read_run(run_dir: str | Path) -> RunState:
    """One complete read of a run directory (for reports and one-shot views)."""
    return RunReader(run_dir).poll(final=True)
