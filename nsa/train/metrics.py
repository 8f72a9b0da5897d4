"""What a running trainer measures and records: step timing, log steps (heartbeat ``progress``, CSV,
TensorBoard, the console/log line), data warnings, ``env.json`` and the ``metrics.json`` summary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nsa.config.settings import read_settings
from nsa.envinfo import GpuProbe
from nsa.ops import fallback_counts as counts
from nsa.rundir.checkpoints import latest_checkpoint
from nsa.rundir.records import METRICS_SCHEMA, SELECTION_FIELDS, Metrics
from nsa.train.telemetry import MFU_FORMULA, environment_record, peak_flops, write_json_atomic

if TYPE_CHECKING:
    from nsa.train.session import Session

MIB = 2**20


@dataclass
class Clock:
    """Wall time of this session: boot, first and last step ends, training time, a log window."""

    boot: float = field(default_factory=time.perf_counter)
    elapsed0: float = 0.0  # elapsed_s of the run before this session (from the checkpoint)
    start_step: int = 0
    first_step_end: float | None = None
    last_step_end: float = 0.0
    tokens_after_first: int = 0
    train_s: float = 0.0
    compile_s: float | None = None
    window: list[float] = field(default_factory=lambda: [0, 0.0, 0.0])  # steps, seconds, fetch seconds

    def elapsed(self) -> float:
        return self.elapsed0 + (time.perf_counter() - self.boot)

    def step_done(self, dt: float, fetch_s: float, tokens: int) -> bool:
        """Record a step of ``dt`` seconds; True for the session's first step."""
        self.train_s += dt
        self.last_step_end = time.perf_counter()
        first = self.first_step_end is None
        if first:
            self.first_step_end = self.last_step_end
        else:
            self.tokens_after_first += tokens
        self.window = [self.window[0] + 1, self.window[1] + dt, self.window[2] + fetch_s]
        return first

    def take_window(self) -> tuple[int, float, float]:
        n, t, f = self.window
        self.window = [0, 0.0, 0.0]
        return int(n), t, f

    def tokens_per_s(self) -> float | None:
        if self.first_step_end is None or self.tokens_after_first <= 0:
            return None
        return self.tokens_after_first / (self.last_step_end - self.first_step_end)


def memory(device_type: str, device: torch.device) -> dict[str, float | None]:
    import psutil

    rss = psutil.Process().memory_info().rss / MIB
    if device_type != "cuda":
        return {"mem_allocated_mib": None, "mem_reserved_mib": None, "mem_peak_mib": None, "rss_mib": rss}
    return {
        "mem_allocated_mib": torch.cuda.memory_allocated(device) / MIB,
        "mem_reserved_mib": torch.cuda.memory_reserved(device) / MIB,
        "mem_peak_mib": torch.cuda.max_memory_allocated(device) / MIB,
        "rss_mib": rss,
    }


def fallback_counts(since: dict[str, int] | None = None) -> dict[str, int]:
    """The process's fallbacks to the torch path (``nsa.ops.fallback_counts``), less those counted by
    ``since``: a session's own when several run in one process (``nsa bench quality``'s arms, tests)."""
    before = since or {}
    return {k: n - before.get(k, 0) for k, n in counts().items() if n > before.get(k, 0)}


class Recorder:
    """Log steps, evaluation rows, data warnings, ``env.json`` and ``metrics.json`` of one session."""

    def __init__(self, s: Session, clock: Clock) -> None:
        self.s, self.clock = s, clock
        self.fallbacks_before = fallback_counts()  # this session reports only its own
        self.flops_per_token = float(s.model.flops_per_token(s.cfg.train.seq_len))
        self.num_params = int(s.model.num_params())
        self.warnings: list[str] = []
        self.gpu = _gpu_probe(s)

    def mfu(self, tps: float | None) -> float | None:
        s = self.s
        if tps is None or s.plan.rt.device_type != "cuda":
            return None
        peak, _ = peak_flops(s.device_name, s.cfg.logging.mfu_peak_tflops)
        return None if peak is None else tps * self.flops_per_token / (s.dist.world_size * peak)

    def new_data_warnings(self) -> list[str]:
        """Loader warnings (e.g. a failed source replaced by synthetic tokens), shown loudly once each."""
        s = self.s
        current = [str(w) for w in (s.loader.stats().get("warnings") or [])]
        new = [w for w in current if w not in self.warnings]
        for w in new:
            self.warnings.append(w)
            if s.dist.is_main:
                s.out.warn(f"data: {w}")
                if s.plan.files.env.exists():
                    self.write_env()
        return new

    def write_env(self) -> None:
        s, plan = self.s, self.s.plan
        settings = {f"NSA_{k.upper()}": v for k, v in read_settings().model_dump(exclude_none=True).items()}
        record = environment_record(
            device=str(plan.rt.device), device_name=s.device_name, precision=plan.rt.precision,
            world_size=s.dist.world_size, backend=s.dist.backend, profile=plan.resolved.profile,
            config_path=plan.resolved.config_path, nsa_settings=settings,
                                    unknown_nsa=plan.resolved.unknown_env,
        )
        record["run_name"] = plan.run_name
        record["resumed_from"] = str(plan.resume_from) if plan.resume_from else None
        record["data_warnings"] = list(self.warnings)
        write_json_atomic(plan.files.env, record)

    def started(self) -> None:
        """After set-up: the loader-ready event, env.json, and the opening lines."""
        s, tr = self.s, self.s.cfg.train
        warnings = self.new_data_warnings()
        s.hb.emit("loader-ready", s.state.step, source=s.cfg.data.source, source_used=s.loader.source.name,
                  description=s.loader.description,
                  tokenizer=getattr(s.plan.tokenizer, "name", s.cfg.data.tokenizer),
                  first_batch_s=s.first_batch_s, warnings=warnings)
        if s.dist.is_main:
            self.write_env()
        if s.plan.resume_from is not None:
            s.out.message(f"resumed from {s.plan.resume_from} at step {s.state.step}")
        s.out.message(f"model {self.num_params / 1e6:.2f}M params | {s.tokens_per_step} tokens/step | "
                      f"{tr.steps} steps | first batch in {s.first_batch_s:.2f}s")
        s.out.message(f"data: {s.loader.description}")

    def data_read(self) -> str:
        """What this rank's loader read: documents, characters (text sources), skipped records."""
        st = self.s.loader.stats()
        chars = f", {st.get('chars_seen', 0):,} characters" if st.get("chars_seen") else ""
        skipped = f", {st['skipped_total']:,} record(s) skipped" if st.get("skipped_total") else ""
        return f"data read: {st.get('docs_seen', 0):,} documents{chars}{skipped} (epoch {st.get('epoch', 0)})"

    def log_step(self, step: int, loss: float, lr: float, grad_norm: float, fields: dict[str, float],
                 heartbeat_only: bool = False) -> None:
        """A log step: the heartbeat's ``progress`` event, a CSV row, TensorBoard and the console line
        (``heartbeat_only``: the event alone, for ``logging.heartbeat_every`` between log steps). ``fields``:
        the step hooks' (:mod:`nsa.train.hooks`; ``answer_loss``/``answer_acc`` of a synthetic task)."""
        s, tr = self.s, self.s.cfg.train
        n, win_time, fetch_s = self.clock.window if heartbeat_only else self.clock.take_window()
        n = int(n)
        step_time = win_time / max(n, 1)
        tps = n * s.tokens_per_step / win_time if win_time > 0 else None
        eta = (tr.steps - step) * step_time
        stats = s.model.consume_stats() or {}
        loader_stats = s.loader.stats()
        mem = memory(s.plan.rt.device_type, s.plan.rt.device)
        gpu = self.gpu.usage() if self.gpu is not None else {"gpu_util_pct": None, "gpu_mem_used_mib": None}
        mfu = self.mfu(tps)
        self.new_data_warnings()
        row = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps,
            "step_time_s": step_time, "fetch_ms": 1000 * fetch_s / max(n, 1),
               "tokens_seen": s.state.tokens_seen,
            "elapsed_s": self.clock.elapsed(), "eta_s": eta,
            "answer_loss": fields.get("answer_loss"), "answer_acc": fields.get("answer_acc"),
            "fetch_p50_ms": loader_stats.get("fetch_p50_ms"),
               "fetch_p95_ms": loader_stats.get("fetch_p95_ms"),
            "scorer_kl": _float(stats.get("scorer_kl")), "align_nll": _float(stats.get("align_nll")), **mem,
               **gpu,
        }
        shares = stats.get("gate_branch_shares")
        s.hb.emit(
            "progress", step, steps_total=tr.steps, loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tps,
            step_time_s=step_time, fetch_p50_ms=row["fetch_p50_ms"], fetch_p95_ms=row["fetch_p95_ms"],
            tokens_seen=s.state.tokens_seen, elapsed_s=row["elapsed_s"], eta_s=eta, **mem,
            gate_entropy_mean=_float(stats.get("gate_entropy_mean")),
            gate_branch_shares=[float(x) for x in shares] if shares is not None else None,
            gate_collapse_fraction=_float(stats.get("gate_collapse_fraction")),
            sel_keys_mean=_float(stats.get("sel_keys_mean")), mfu=mfu,
            fallback=fallback_counts(self.fallbacks_before),
            data_skipped=_skipped(loader_stats), data_warnings=list(self.warnings),
            answer_loss=row["answer_loss"], answer_acc=row["answer_acc"],
            gpu_mem_errors=self.gpu.read() if self.gpu is not None else None,
            scorer_kl=row["scorer_kl"], align_nll=row["align_nll"], **gpu,
        )
        if heartbeat_only:
            s.out.step(step)
            return
        if not s.dist.is_main:
            s.out.log(row)  # into this rank's log file
            return
        assert s.csv is not None and s.tb is not None
        s.csv.row(row)
        scalars = {
            "train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "perf/tokens_per_s": tps,
            "perf/step_time_s": step_time, "perf/fetch_ms": row["fetch_ms"], "perf/mfu": mfu,
            "perf/fetch_p50_ms": row["fetch_p50_ms"], "perf/fetch_p95_ms": row["fetch_p95_ms"],
            "mem/allocated_mib": mem["mem_allocated_mib"], "mem/reserved_mib": mem["mem_reserved_mib"],
            "mem/peak_mib": mem["mem_peak_mib"], "mem/rss_mib": mem["rss_mib"],
            "gpu/util_pct": gpu["gpu_util_pct"], "gpu/mem_used_mib": gpu["gpu_mem_used_mib"],
            "gate/entropy_mean": _float(stats.get("gate_entropy_mean")),
            "gate/collapse_fraction": _float(stats.get("gate_collapse_fraction")),
            "sel/keys_mean": _float(stats.get("sel_keys_mean")), "sel/scorer_kl": row["scorer_kl"],
            "sel/align_nll": row["align_nll"],
        }
        scalars.update({f"train/{name}": value for name, value in fields.items()})
        if shares is not None:
            scalars.update({f"gate/share_{b}": float(x) for b,
                            x in zip(("cmp", "sel", "win"), shares, strict=False)})
        s.tb.scalars(scalars, step)
        s.out.step(step, row)
        s.out.log(row)

    def eval_row(self, step: int, val_loss: float, ppl: float, seconds: float,
                 selection: list[dict[str, Any]] | None = None) -> None:
        """An evaluation: the heartbeat's ``eval`` event, a ``val.csv`` row, TensorBoard and the message line;
        ``selection``: the NSA layers' :meth:`NSALM.selection_report` (None: not measured, dense model)."""
        s = self.s
        fig = selection_figures(selection or [])
        s.hb.emit("eval", step, val_loss=val_loss, val_ppl=ppl, seconds=seconds, selection=selection or None,
                  sel_recall_mean=fig["sel_recall_mean"], sel_recall_min=fig["sel_recall_min"],
                  cmp_entropy_mean=fig["cmp_entropy_mean"])
        if s.dist.is_main:
            assert s.val_csv is not None and s.tb is not None
            s.val_csv.row({"step": step, "val_loss": val_loss, "val_ppl": ppl,
                           "sel_recall_mean": fig["sel_recall_mean"], "sel_recall_min": fig["sel_recall_min"],
                           "cmp_entropy_mean": fig["cmp_entropy_mean"]})
            s.tb.scalars({"val/loss": val_loss, "val/ppl": ppl, **selection_scalars(selection or [])}, step)
            s.out.message(f"eval step {step}: val_loss {val_loss:.4f} | ppl {ppl:.2f}{selection_text(fig)}")

    def summary(self, status: str, error: str | None) -> Metrics:
        """The content of ``metrics.json``."""
        s, plan, c = self.s, self.s.plan, self.clock
        st = s.state
        tps = c.tokens_per_s()
        peak, peak_source = peak_flops(s.device_name, s.cfg.logging.mfu_peak_tflops)
        loader_stats = s.loader.stats()
        done_here = st.step - c.start_step
        return {
            "schema": METRICS_SCHEMA, "status": status, "error": error, "run_name": plan.run_name,
            "steps_done": st.step, "steps_total": s.cfg.train.steps, "steps_this_session": done_here,
            "final_loss": st.last_loss, "last_val_loss": st.last_val_loss, "best_val_loss": st.best_val_loss,
            "tokens_seen": st.tokens_seen, "tokens_per_step": s.tokens_per_step, "tokens_per_s": tps,
            "tokens_per_s_note": (
                "tokens of this session's steps after its first, over the wall time from the end of the "
                "first step to the end of the last (evaluations and periodic checkpoints in between included)"
            ),
            "train_time_s": c.train_s,
            "mean_step_time_s": c.train_s / done_here if done_here else None,
            "elapsed_s": c.elapsed(),
            "startup_s": (c.first_step_end or time.perf_counter()) - c.boot,
            "compiled": s.compiled, "compile_s": c.compile_s,
            "num_params": self.num_params, "flops_per_token": self.flops_per_token,
            "mfu": self.mfu(tps), "mfu_formula": MFU_FORMULA, "mfu_peak_flops_per_device": peak,
            "mfu_peak_source": peak_source,
            "device": str(plan.rt.device), "device_name": s.device_name, "precision": plan.rt.precision,
            "world_size": s.dist.world_size,
            "resumed_from": str(plan.resume_from) if plan.resume_from else None,
            "last_checkpoint": str(p) if (p := latest_checkpoint(plan.run_dir)) else None,
            "memory": memory(plan.rt.device_type, plan.rt.device),
            "fallback": fallback_counts(self.fallbacks_before),
            "data": {k: v for k, v in loader_stats.items() if k != "warnings"},
            "data_warnings": list(self.warnings),
        }


def measure_selection(s: Session, x: torch.Tensor) -> list[dict[str, Any]] | None:
    """The NSA layers' selection diagnostics on the held-out inputs ``x`` (:meth:`NSALM.selection_report`,
    ``eval.selection_queries`` query positions per layer, under the run's autocast, no gradient); None when
    off (``eval.selection_queries: 0``), for a dense model or under context parallelism (it needs whole
    sequences). Every rank runs it (under FSDP the report's forward gathers the shards like any other)."""
    queries = s.cfg.eval.selection_queries
    if queries <= 0 or s.cfg.model.attention == "dense" or s.context is not None:
        return None
    with torch.no_grad(), s.plan.rt.autocast():
        layers = s.model.selection_report(x, queries, cu_seqlens=s.documents(x))
    return [_layer_record(r) for r in layers] or None


def _layer_record(r: dict[str, Any]) -> dict[str, Any]:
    gates = r.get("gates")
    return {"layer": int(r["layer"]), **{k: _float(r.get(k)) for k in SELECTION_FIELDS},
            "gates": [float(g) for g in gates] if gates is not None else None}


def selection_figures(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """``sel_recall_mean``, ``sel_recall_min`` (and ``sel_recall_min_layer``) and ``cmp_entropy_mean`` over
    the layers that have them (None each when none does: a dense model, or a sequence too short to select)."""
    recalls = [(r["recall"], r["layer"]) for r in layers if r.get("recall") is not None]
    ents = [r["cmp_entropy"] for r in layers if r.get("cmp_entropy") is not None]
    low = min(recalls) if recalls else None
    return {"sel_recall_mean": sum(v for v, _ in recalls) / len(recalls) if recalls else None,
            "sel_recall_min": low[0] if low else None, "sel_recall_min_layer": low[1] if low else None,
            "cmp_entropy_mean": sum(ents) / len(ents) if ents else None}


def selection_scalars(layers: list[dict[str, Any]]) -> dict[str, float | None]:
    """TensorBoard scalars: ``sel/recall_L{i}``, ``sel/cmp_entropy_L{i}``, ``sel/kl_L{i}``,
    ``gate/L{i}_{cmp|sel|win}`` and ``sel/recall_mean``."""
    out: dict[str, float | None] = {}
    for r in layers:
        i = r["layer"]
        out.update({f"sel/recall_L{i}": r.get("recall"), f"sel/cmp_entropy_L{i}": r.get("cmp_entropy"),
                    f"sel/kl_L{i}": r.get("kl")})
        for name, g in zip(("cmp", "sel", "win"), r.get("gates") or [], strict=False):
            out[f"gate/L{i}_{name}"] = g
    if layers:
        out["sel/recall_mean"] = selection_figures(layers)["sel_recall_mean"]
    return out


def selection_text(fig: dict[str, Any]) -> str:
    """`` | recall 0.83 (min L3 0.61)`` for the eval line; empty without a recall."""
    if fig.get("sel_recall_mean") is None:
        return ""
    return (f" | recall {fig['sel_recall_mean']:.2f} (min L{fig['sel_recall_min_layer']} "
            f"{fig['sel_recall_min']:.2f})")


def _gpu_probe(s: Session) -> Any:
    """NVML's view of this rank's GPU (memory errors, utilisation, memory used; CUDA runs), closed with the
    session; None on CPU."""
    if s.plan.rt.device_type != "cuda":
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(s.plan.rt.device).uuid)
    except Exception:
        uuid = None
    probe = GpuProbe(uuid)
    s.closers.callback(probe.close)
    return probe


def _float(v: Any) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _skipped(stats: dict[str, Any]) -> dict[str, int]:
    """Counts of records the loader skipped, by reason (``skipped`` dict or ``skipped_*`` keys)."""
    out: dict[str, int] = {}
    raw = stats.get("skipped")
    if isinstance(raw, dict):
        out.update({str(k): int(v) for k, v in raw.items()})
    elif isinstance(raw, int | float):
        out["total"] = int(raw)
    for k, v in stats.items():
        if k.startswith("skipped_") and isinstance(v, int | float):
            out[k.removeprefix("skipped_")] = int(v)
    return out
