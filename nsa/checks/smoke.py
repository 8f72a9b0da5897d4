"""``nsa smoke``: preflight, parity of every fast path against the reference, a short training run, and
a verdict against explicit criteria (loss decreased, all finite, tokens/s floor, fetch p95 limit, gate
health, zero fallbacks, fresh heartbeat)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nsa.checks.parity import SHAPES, check_backend
from nsa.checks.preflight import run_preflight
from nsa.checks.result import Check, CheckReport, Status, failed, passed, warned
from nsa.config import load_run_config
from nsa.config.profiles import list_profiles, load_profile
from nsa.errors import NSAError
from nsa.gpuinfo import query_gpus
from nsa.ops import available_backends
from nsa.runs.reader import read_run
from nsa.runs.summary import summarize
from nsa.train.trainer import Trainer


def detect_profile() -> str:
    """The shipped profile that fits this machine: ``cpu`` without CUDA, else the first whose GPU name
    pattern and memory match GPU 0 (``cpu`` when none does)."""

    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        return "cpu"
    probe = query_gpus()
    if not probe.available or not probe.gpus:
        return "cpu"
    g = probe.gpus[0]
    fits = []
    for p in list_profiles():
        e = p.expect
        if e.device != "cuda" or not e.gpu_name_pattern or not re.search(e.gpu_name_pattern, g.name, re.I):
            continue
        if e.min_memory_gib and g.memory_total_mib / 1024 < e.min_memory_gib:
            continue
        fits.append((e.min_memory_gib or 0, p.name))
    return max(fits)[1] if fits else "cpu"


def parity_checks(device: str, atol: float | None = None, seed: int | None = None) -> list[Check]:
    """Every backend available on ``device`` (besides the reference) against the reference, two shapes."""

    out = []
    dtypes = ["float32"] if device == "cpu" else ["bfloat16"]
    for backend in [b for b in available_backends(device) if b != "reference"]:
        for dtype in dtypes:
            results = [check_backend(backend, device, dtype, shape, seed=seed,
                                     atol=atol if dtype == "float32" else None) for shape in SHAPES]
            worst_f = max(r.max_fwd_err for r in results)
            worst_g = max(r.max_grad_err for r in results)
            fb = sum(r.fallbacks for r in results)
            name = f"parity-{backend}-{dtype}"
            text = (f"{backend} vs reference on {device} {dtype}, shapes {', '.join(SHAPES)}: fwd "
                    f"{worst_f:.1e}, grad {worst_g:.1e} (tol {results[0].atol:.0e})")
            details = {"results": [r.to_dict() for r in results]}
            if fb:
                out.append(failed(name, text + f"; {fb} fallback(s) to torch",
                                  "the backend cannot serve these shapes", **details))
            elif not all(r.ok for r in results):
                out.append(failed(name, text + ": mismatch", "do not train on this backend; file the numbers",
                                  **details))
            else:
                out.append(passed(name, text, **details))
    return out


def verdict_checks(summary: Any, smoke: Any, run_status: str, now: float,
                   metrics: Mapping[str, Any] | None = None) -> list[Check]:
    """The explicit criteria, each a check (``metrics``: the run's metrics.json, for the compile mode)."""
    s = summary
    m = metrics or {}
    mode = ("" if "compiled" not in m else
            f" (torch.compile, compiled in {m['compile_s']:.0f} s)" if m.get("compiled")
            and isinstance(m.get("compile_s"), int | float)
            else " (torch.compile)" if m.get("compiled") else " (eager)")
    out = []
    if run_status != "completed":
        err = (s.end or {}).get("error")
        out.append(failed("run-completed",
                          f"training ended {run_status} at step {s.steps_done}" + (f": {err}" if err else ""),
                          "read the run's heartbeat and stackdump files"))
    else:
        out.append(passed("run-completed",
                          f"{s.steps_done}/{s.steps_total} steps in {s.elapsed_s or 0:.1f} s"))
    if s.first_loss is None or s.last_loss is None:
        out.append(failed("loss-decreased", "no loss recorded", "check training.csv"))
    elif s.last_loss < s.first_loss - smoke.min_loss_drop:
        out.append(passed("loss-decreased", f"loss {s.first_loss:.4f} -> {s.last_loss:.4f}"))
    else:
        out.append(failed("loss-decreased",
                          f"loss {s.first_loss:.4f} -> {s.last_loss:.4f} (needs a drop of > "
                          f"{smoke.min_loss_drop:g})", "check the learning rate and data; run more steps"))
    if s.nonfinite_losses or s.anomalies:
        out.append(failed("finite",
                          f"{s.nonfinite_losses} non-finite loss(es), {len(s.anomalies)} anomaly record(s)",
                          "see anomalies/ in the run directory"))
    else:
        out.append(passed("finite", "no non-finite losses or gradients"))
    tps = s.tokens_per_s_median
    if tps is None:
        out.append(failed("tokens-per-s", "no throughput recorded", "check the heartbeat"))
    elif tps >= smoke.min_tokens_per_s:
        out.append(passed("tokens-per-s",
                          f"median {tps:,.0f} tokens/s{mode} >= floor {smoke.min_tokens_per_s:,.0f}"))
    else:
        out.append(failed("tokens-per-s",
                          f"median {tps:,.0f} tokens/s{mode} < floor {smoke.min_tokens_per_s:,.0f}",
                          "check GPU clocks/other processes, the backend (fallbacks) and the profile"))
    p95 = s.fetch_p95_ms
    if p95 is None:
        out.append(warned("fetch-p95", "no fetch timing recorded", "check the heartbeat"))
    elif p95 <= smoke.max_fetch_p95_ms:
        out.append(passed("fetch-p95",
                          f"fetch p50 {s.fetch_p50_ms or 0:.1f} ms, p95 {p95:.1f} ms <= "
                          f"{smoke.max_fetch_p95_ms:g} ms"))
    else:
        out.append(failed("fetch-p95", f"fetch p95 {p95:.1f} ms > {smoke.max_fetch_p95_ms:g} ms",
                          "raise NSA_PREFETCH_DEPTH or use a local dataset copy"))
    ent, col = s.gate_entropy_mean, s.gate_collapse_fraction
    if ent is None or col is None:
        out.append(warned("gate-health", "no gate statistics recorded", "the dense baseline has no gates"))
    elif ent >= smoke.min_gate_entropy and col <= smoke.max_gate_collapse:
        shares = "/".join(f"{x:.2f}" for x in s.gate_branch_shares or [])
        out.append(passed("gate-health",
                          f"entropy {ent:.3f}, collapsed {col:.2f}, shares cmp/sel/win {shares}"))
    else:
        out.append(failed("gate-health", f"entropy {ent:.3f} (min {smoke.min_gate_entropy:g}), collapsed "
                          f"{col:.2f} (max {smoke.max_gate_collapse:g})",
                          "lower the learning rate; inspect gate_branch_shares"))
    if s.fallback_total:
        out.append(failed("fallbacks",
                          f"{s.fallback_total} fallback(s): "
                          + ", ".join(f"{k}={v}" for k, v in s.fallback.items()),
                          "the requested backend could not serve these shapes; see nsa.ops.fallback_counts"))
    else:
        out.append(passed("fallbacks", "fallback counters at zero"))
    ages = s.heartbeat_age_s
    age = max(ages.values()) if ages else None
    if age is None:
        out.append(failed("heartbeat", "no heartbeat written",
                          "check write permissions in the run directory"))
    elif age <= smoke.max_heartbeat_age_s:
        out.append(passed("heartbeat",
                          f"last heartbeat {age:.1f} s old (<= {smoke.max_heartbeat_age_s:g} s)"))
    else:
        out.append(failed("heartbeat", f"last heartbeat {age:.0f} s old (> {smoke.max_heartbeat_age_s:g} s)",
                          "the trainer stalled; look at stackdump_*.txt"))
    return out


def run_smoke(
    profile: str | None = None,
    steps: int | None = None,
    *,
    config: str | None = None,
    out_dir: str | Path | None = None,
    environ: dict[str, str] | None = None,
    reporter: Callable[[Any], None] | None = None,
    on_stage: Callable[[str, CheckReport], None] | None = None,
    skip_preflight: bool = False,
) -> CheckReport:
    """Run the smoke test; the result's checks hold preflight (prefixed), parity and the criteria."""

    report = CheckReport("smoke")
    name = profile or detect_profile()
    prof = load_profile(name)  # a bad --profile is a usage error (ConfigError)
    smoke = prof.smoke
    config = config or smoke.config
    # each value's origin as typed: the flag, or where the smoke's own default came from
    origins = {"train.steps": "--steps" if steps else f"profile {prof.name} smoke.steps",
               "train.out_dir": "--out-dir" if out_dir is not None else "nsa smoke (its default run "
                                                                        "directory)"}
    steps = steps or smoke.steps
    if out_dir is None:
        out_dir = Path("artifacts") / f"smoke-{prof.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = Path(out_dir)
    sets = list(smoke.sets)
    report.facts.update({"profile": prof.name, "config": config, "steps": steps, "run_dir": str(out_dir)})

    # 1. preflight
    if not skip_preflight:
        pre = run_preflight(prof.name if profile is None else profile, config, environ=environ,
                            out_dir=out_dir, sets=sets)
        report.facts["preflight"] = pre.to_dict()
        fails = [c for c in pre.checks if c.status is Status.FAIL]
        warns = [c for c in pre.checks if c.status is Status.WARN]
        if fails:
            report.add(failed("preflight", "; ".join(f"{c.name}: {c.reason}" for c in fails)[:300],
                              fails[0].hint or "run nsa preflight for details"))
        else:
            report.add(Check("preflight", Status.WARN if warns else Status.PASS,
                             f"{len(pre.checks) - len(warns)} passed, {len(warns)} warning(s)"
                             + (f" ({', '.join(c.name for c in warns)})" if warns else "")))
        if on_stage:
            on_stage("preflight", report)
        if fails:
            return report

    # 2. resolve the smoke run's config (usage errors surface as ConfigError)
    flags: dict[str, Any] = {"train.steps": steps, "train.out_dir": str(out_dir)}
    resolved = load_run_config(config, profile=profile or prof.name, environ=environ, flags=flags, sets=sets,
                               flag_names=origins)
    device = resolved.config.runtime.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"

    # 3. parity of every fast path against the reference
    report.run("parity", lambda: parity_checks(device, atol=smoke.parity_atol))
    if on_stage:
        on_stage("parity", report)

    # 4. the short training run
    t0 = time.time()
    try:
        result = Trainer(resolved, reporter=reporter).fit()
        run_status = str(getattr(result.status, "value", result.status))
    except NSAError as exc:
        report.add(failed("train", f"training could not start: {exc.message}", exc.hint or ""))
        return report
    except Exception as exc:  # a crash is a smoke failure, reported, not a traceback
        report.add(failed("train",
                          f"training crashed: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}",
                          "rerun with --debug; see the run directory's stackdump and heartbeat"))
        run_status = "crashed"
    report.facts["train_seconds"] = round(time.time() - t0, 1)
    if on_stage:
        on_stage("train", report)

    # 5. verdict from the run directory's own records
    state = read_run(out_dir)
    summary = summarize(state, time.time())
    if run_status == "crashed" and summary.status != "running":
        run_status = summary.status
    report.facts["summary"] = summary.to_dict()
    for c in verdict_checks(summary, smoke, run_status, time.time(), state.metrics):
        report.add(c)
    return report
