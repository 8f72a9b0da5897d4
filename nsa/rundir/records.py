"""The records a run directory holds, as types: the vocabulary its writer (the trainer, ``nsa watch``, ``nsa
eval``) and its readers (``nsa.runs``, the report, ``nsa watch``, the model loader) share. Each record is a
``TypedDict`` naming its fields (``total=False``: a reader never assumes a field, older files lack some), so
the type checker holds every writer and reader to the same spelling; the field tuples (:data:`EVENT_FIELDS`,
:data:`TRAIN_CSV_HEADER`, ...) are derived from them. Every JSON record carries ``"schema"``; a reader checks
it with :func:`newer_schema` and says when a file was written by a newer nsa. Torch-free.

The heartbeat's table is also in ``docs/run-directory.md`` (a test keeps the two equal).
"""

from __future__ import annotations

from typing import Any, TypedDict

HEARTBEAT_SCHEMA = 1  # heartbeat_rank{r}.jsonl lines
METRICS_SCHEMA = 1  # metrics.json
ENV_SCHEMA = 1  # env.json
ALARMS_SCHEMA = 1  # alarms.jsonl lines
EVAL_SCHEMA = 1  # eval/<task>.json


# ---------------------------------------------------------------------------------- heartbeat events


class Event(TypedDict, total=False):
    """The fields of every heartbeat line (``step``: optimizer steps completed when it was written)."""

    schema: int
    event: str
    ts: float
    rank: int
    pid: int
    step: int


class BootEvent(Event, total=False):
    run_name: str
    world_size: int
    local_rank: int
    host: str
    device: str
    resumed_from: str | None
    steps_total: int


class LoaderReadyEvent(Event, total=False):
    source: str
    source_used: str
    description: str
    tokenizer: str
    first_batch_s: float
    warnings: list[str]


class ProgressEvent(Event, total=False):
    steps_total: int
    loss: float | None
    lr: float
    grad_norm: float | None
    tokens_per_s: float | None
    step_time_s: float
    fetch_p50_ms: float | None
    fetch_p95_ms: float | None
    tokens_seen: int
    elapsed_s: float
    eta_s: float
    mem_allocated_mib: float | None
    mem_reserved_mib: float | None
    mem_peak_mib: float | None
    rss_mib: float | None
    gate_entropy_mean: float | None
    gate_branch_shares: list[float] | None
    gate_collapse_fraction: float | None
    sel_keys_mean: float | None
    fallback: dict[str, int]
    mfu: float | None
    data_skipped: dict[str, int]
    data_warnings: list[str]
    answer_loss: float | None
    answer_acc: float | None
    gpu_mem_errors: dict[str, int] | None
    scorer_kl: float | None
    align_nll: float | None
    gpu_util_pct: float | None
    gpu_mem_used_mib: float | None


SELECTION_FIELDS = ("recall", "recall_best", "recall_forced", "cmp_entropy", "kl")
"""The numbers of a :class:`LayerSelection` (besides ``layer`` and ``gates``), in the order tables show
them."""


class LayerSelection(TypedDict, total=False):
    """One NSA layer's selection diagnostics (an ``eval`` event's ``selection``)."""

    layer: int
    recall: float | None
    recall_best: float | None  # recall's ceiling (a perfect block scorer's)
    recall_forced: float | None  # the share in the forced blocks alone (first, current, previous)
    cmp_entropy: float | None
    kl: float | None
    gates: list[float] | None


class EvalEvent(Event, total=False):
    val_loss: float
    val_ppl: float
    seconds: float
    selection: list[LayerSelection] | None
    sel_recall_mean: float | None
    sel_recall_min: float | None
    cmp_entropy_mean: float | None


class CheckpointEvent(Event, total=False):
    path: str
    seconds: float
    reason: str  # periodic, signal, halt, final


class AnomalyEvent(Event, total=False):
    kind: str  # nonfinite_loss, nonfinite_grad
    value: str
    record: str  # anomalies/step_N.json, relative to the run directory


class HaltEvent(Event, total=False):
    reason: str
    source: str  # file, SIGTERM, SIGINT, anomaly
    checkpoint: str | None
    rule: str | None  # the watch rule of a watchdog's .HALT (None otherwise)


class EndEvent(Event, total=False):
    status: str  # completed, halted, failed, interrupted
    error: str | None


COMMON_FIELDS: tuple[str, ...] = tuple(Event.__annotations__)
EVENTS: dict[str, type] = {
    "boot": BootEvent, "loader-ready": LoaderReadyEvent, "progress": ProgressEvent, "eval": EvalEvent,
    "checkpoint": CheckpointEvent, "anomaly": AnomalyEvent, "halt": HaltEvent, "end": EndEvent,
}
# event -> its own fields (every line also has COMMON_FIELDS), in declaration order
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    name: tuple(k for k in cls.__annotations__ if k not in COMMON_FIELDS) for name, cls in EVENTS.items()
}


# ----------------------------------------------------------------------------------------- CSV rows


class TrainRow(TypedDict, total=False):
    """A ``training.csv`` row (a log step), columns in this order."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float | None
    step_time_s: float
    fetch_ms: float
    tokens_seen: int
    elapsed_s: float
    answer_loss: float | None
    answer_acc: float | None
    scorer_kl: float | None
    align_nll: float | None
    fetch_p50_ms: float | None
    fetch_p95_ms: float | None
    mem_allocated_mib: float | None
    mem_reserved_mib: float | None
    mem_peak_mib: float | None
    rss_mib: float | None
    gpu_util_pct: float | None
    gpu_mem_used_mib: float | None


class ValRow(TypedDict, total=False):
    """A ``val.csv`` row (an evaluation), columns in this order."""

    step: int
    val_loss: float
    val_ppl: float
    sel_recall_mean: float | None
    sel_recall_min: float | None
    cmp_entropy_mean: float | None


TRAIN_CSV_HEADER: tuple[str, ...] = tuple(TrainRow.__annotations__)
VAL_CSV_HEADER: tuple[str, ...] = tuple(ValRow.__annotations__)


# ------------------------------------------------------------------------------------- JSON files


class Metrics(TypedDict, total=False):
    """``metrics.json``: the summary written when a session ends (completed, halted, failed, interrupted)."""

    schema: int
    status: str
    error: str | None
    run_name: str
    steps_done: int
    steps_total: int
    steps_this_session: int
    final_loss: float | None
    last_val_loss: float | None
    best_val_loss: float | None
    tokens_seen: int
    tokens_per_step: int
    tokens_per_s: float | None
    tokens_per_s_note: str
    train_time_s: float
    mean_step_time_s: float | None
    elapsed_s: float
    startup_s: float
    compiled: bool
    compile_s: float | None
    num_params: int
    flops_per_token: float
    mfu: float | None
    mfu_formula: str
    mfu_peak_flops_per_device: float | None
    mfu_peak_source: str
    device: str
    device_name: str
    precision: str
    world_size: int
    resumed_from: str | None
    last_checkpoint: str | None
    memory: dict[str, float | None]
    fallback: dict[str, int]
    data: dict[str, Any]
    data_warnings: list[str]


class Env(TypedDict, total=False):
    """``env.json``: where and with what the run trains (rewritten when a data warning appears)."""

    schema: int
    time: float
    host: str
    platform: str
    cpu_count: int | None
    argv: list[str]
    cwd: str
    versions: dict[str, str | None]
    device: str
    device_name: str
    precision: str
    world_size: int
    backend: str | None
    driver: str | None
    gpus: list[str]
    git: dict[str, Any]
    profile: str | None
    config_path: str | None
    nsa_settings: dict[str, str]
    nsa_unknown_variables: list[str]
    environment: dict[str, str]
    run_name: str
    resumed_from: str | None
    data_warnings: list[str]


class Anomaly(TypedDict, total=False):
    """``anomalies/step_N.json``: a step whose loss or gradient norm was not finite (not applied)."""

    step: int
    kind: str
    value: str
    loss: str
    grad_norm: str
    lr: float
    time: float
    applied: bool
    last_good_checkpoint: str | None
    fault_injected: bool


class Alarm(TypedDict, total=False):
    """An ``alarms.jsonl`` line: an alarm ``nsa watch`` raised, its clearing, or an operator's ``ack``."""

    schema: int
    event: str  # alarm, cleared, ack
    time: float
    rule: str
    message: str
    evidence: dict[str, Any]
    step: Any
    session: float | None  # the ts of rank 0's boot line of the session it belongs to
    by: str
    reason: str  # an ack's


class HaltFile(TypedDict, total=False):
    """``.HALT``: a stop request (``nsa halt``, the watchdog; any text is a reason too)."""

    reason: str
    time: float
    who: str
    rule: str  # the watchdog's rule (nsa watch --halt-on)
    evidence: dict[str, Any]
    requests: list[dict[str, Any]]  # each request while one was pending (their reasons joined in ``reason``)


class Lock(TypedDict, total=False):
    """``.lock``: who holds (or last held) the run directory."""

    pid: int
    host: str
    since: float


class ExportInfo(TypedDict, total=False):
    """``export/export.json``: which weights the export holds."""

    step: int | None
    sha256: str
    time: float


class EvalResult(TypedDict, total=False):
    """``eval/<task>.json``: an ``nsa eval`` result and the weights it evaluated."""

    schema: int
    task: str
    run: str | None
    checkpoint: str | None
    step: int | None
    weights: dict[str, str | None]
    results: list[dict[str, Any]]
    settings: dict[str, Any]
    env: dict[str, Any]


def newer_schema(record: Any, known: int) -> int | None:
    """The record's ``schema`` when it is newer than ``known`` (written by a newer nsa: fields may have
    changed meaning), else None; a record without one reads as schema 1."""
    schema = record.get("schema", 1) if isinstance(record, dict) else 1
    return schema if isinstance(schema, int) and not isinstance(schema, bool) and schema > known else None


def schema_note(what: str, schema: int, known: int) -> str:
    """``metrics.json is schema 2, written by a newer nsa (this one reads schema 1): figures may be
    missing``."""
    return (f"{what} is schema {schema}, written by a newer nsa (this one reads schema {known}): figures may "
            "be missing")
