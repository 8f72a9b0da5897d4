"""``nsa report`` as an operator's verdict: each monitor limit judged from synthetic run directories, watchdog
halts (a hang) failing the run, the environment section with secrets redacted, engineer's notes, and the
charts (loss with validation points and markers, tokens/s panels, memory, gates, fetch, lr/grad norm)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from nsa.runs.halt import write_halt
from nsa.runs.report import Check, build_report
from nsa_cli.app import app
from tests.conftest import write_run

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"
STALE = "watchdog: stale: rank 0 heartbeat is 412 s old (> 300 s) at step 40"  # watchdog_reason(rule, message)


def patch_progress(run: Path, **fields: Any) -> None:
    """Set ``fields`` on every progress line of every heartbeat (a value, or a function of the step)."""
    for hb in run.glob("heartbeat_rank*.jsonl"):
        out = []
        for line in hb.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "progress":
                ev.update({k: v(ev["step"]) if callable(v) else v for k, v in fields.items()})
            out.append(json.dumps(ev))
        hb.write_text("\n".join(out) + "\n")


def set_monitor(run: Path, **limits: Any) -> None:
    """Save ``monitor.*`` limits in the run's config.yaml, as a profile's monitor: block would at training."""
    path = run / "config.yaml"
    text = path.read_text()
    body, _, sources = text.partition("# _sources")
    cfg = yaml.safe_load(body)
    cfg["monitor"] = {"stale_s": 180.0, "gate_entropy_min": 0.2, "gate_collapse_max": 0.5, **limits}
    path.write_text(yaml.safe_dump(cfg) + "# _sources" + sources + "".join(
        f"#   monitor.{k}: profile h100-test\n" for k in limits))


def write_eval(run: Path, task: str, accuracies: list[float]) -> None:
    rows = [{"context": 4096 * (i + 1), "depth": 0.5, "accuracy": a, "n": 32} for i, a in enumerate(accuracies)]
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / f"{task}.json").write_text(json.dumps({
        "task": task, "run": str(run), "checkpoint": str(run / "export" / "model.safetensors"), "results": rows,
        "settings": {"samples": 32, "seed": 0, "haystack": "random", "pairs": 8, "queries": 8}, "env": {"date": "x"}}))


def check(res: Any, name: str) -> Check:
    return next(c for c in res.checks[0] if c.name == name)


def report(run: Path, tmp_path: Path, **kwargs: Any) -> Any:
    return build_report([run], tmp_path / "rep", charts=False, **kwargs)


# ------------------------------------------------------------------------------------------- limits


def _low_entropy(run: Path) -> None:
    patch_progress(run, gate_entropy_mean=0.05)


def _peak_40_gib(run: Path) -> None:
    patch_progress(run, mem_allocated_mib=30_000.0, mem_reserved_mib=38_000.0, mem_peak_mib=40 * 1024.0)


def _needle(run: Path) -> None:
    write_eval(run, "needle", [1.0, 0.97, 0.41])
    write_eval(run, "mqar", [0.95])


LIMIT_CASES: list[tuple[str, str, dict[str, Any], Callable[[Path], None] | None, dict[str, Any], dict[str, Any]]] = [
    # check name, monitor key, write_run kwargs, patch, limits that fail, limits that pass
    ("throughput", "min_tokens_per_s", {"tokens_per_s": 1000.0}, None, {"min_tokens_per_s": 5000}, {"min_tokens_per_s": 100}),
    ("fetch p95", "max_fetch_p95_ms", {"fetch_p95_ms": 800.0}, None, {"max_fetch_p95_ms": 100}, {"max_fetch_p95_ms": 2000}),
    # 40 steps: the early minimum (default 0.5) applies
    ("gate entropy", "gate_entropy_early_min", {}, _low_entropy, {}, {"gate_entropy_early_min": 0.01}),
    ("gate collapse", "gate_collapse_max", {"collapse": 0.8}, None, {},  # default max 0.1
     {"gate_collapse_max": 0.9, "gate_entropy_early_min": 0.2}),
    ("peak GPU memory", "max_memory_gib", {}, _peak_40_gib, {"max_memory_gib": 32}, {"max_memory_gib": 64}),
    ("eval accuracy", "min_eval_accuracy", {}, _needle, {"min_eval_accuracy": 0.9}, {"min_eval_accuracy": 0.3}),
]


@pytest.mark.parametrize(("name", "key", "kwargs", "patch", "failing", "passing"), LIMIT_CASES,
                         ids=[c[0].replace(" ", "-") for c in LIMIT_CASES])
def test_each_limit_fails_and_passes(tmp_path: Path, name: str, key: str, kwargs: dict[str, Any],
                                     patch: Callable[[Path], None] | None, failing: dict[str, Any],
                                     passing: dict[str, Any]) -> None:
    run = write_run(tmp_path / "run", seed=11, **kwargs)
    if patch is not None:
        patch(run)
    set_monitor(run, **failing)
    res = report(run, tmp_path)
    c = check(res, name)
    assert c.result == "FAIL" and c.key == key, c
    assert res.verdicts[0][0] == "FAIL" and c.why in res.verdicts[0][1]
    text = res.path.read_text()
    assert f"| {c.name} | {c.figure} | {c.limit} | **FAIL** |" in text and f"`monitor.{key}`" in c.limit
    set_monitor(run, **passing)
    res = report(run, tmp_path)
    assert check(res, name).result == "PASS" and res.verdicts[0][0] == "PASS", res.checks[0]


def test_limit_figures_and_sources(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", seed=12, tokens_per_s=1000.0)
    _needle(run)
    set_monitor(run, min_tokens_per_s=5000, min_eval_accuracy=0.9)
    res = report(run, tmp_path)
    tps, ev = check(res, "throughput"), check(res, "eval accuracy")
    assert tps.limit == ">= 5,000 tokens/s (`monitor.min_tokens_per_s`, config.yaml, from profile h100-test)"
    assert tps.figure.startswith("median ") and "tokens/s" in tps.figure
    assert ev.figure == "lowest 0.410 (needle context 12K depth 0.5)" and "below the minimum 0.9" in ev.why
    assert check(res, "gate entropy").limit == ">= 0.5 nats (`monitor.gate_entropy_early_min`, default)"


def test_unset_limits_do_not_judge_and_missing_figures_are_na(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", seed=13)  # config without a monitor section: the defaults
    res = report(run, tmp_path)
    assert res.verdicts[0][0] == "PASS", res.verdicts
    results = {c.name: c.result for c in res.checks[0]}
    assert results["throughput"] == results["fetch p95"] == results["eval accuracy"] == "not set"
    assert results["gate entropy"] == results["gate collapse"] == "PASS"  # default limits 0.5 early / 0.1
    assert "not set (`monitor.min_tokens_per_s`)" in res.path.read_text()
    set_monitor(run, max_memory_gib=10, min_eval_accuracy=0.5)
    res = report(run, tmp_path)
    mem = check(res, "peak GPU memory")
    assert mem.result == "n/a" and "CPU run" in mem.figure and res.verdicts[0][0] == "PASS"
    assert check(res, "eval accuracy").result == "n/a"


def test_fetch_p95_is_the_worst_window_after_start_up(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", seed=16, steps=100, fetch_p95_ms=20.0)
    patch_progress(run, fetch_p95_ms=lambda s: 3000.0 if s == 5 or 50 <= s <= 60 else 20.0)
    set_monitor(run, max_fetch_p95_ms=500)
    c = check(report(run, tmp_path), "fetch p95")
    assert c.result == "FAIL" and c.figure == "worst 3,000.0 ms at step 50 (last 20.0 ms)"  # a stall that recovered
    patch_progress(run, fetch_p95_ms=lambda s: 3000.0 if s == 5 else 20.0)  # only the start-up window: few fetches
    assert check(report(run, tmp_path), "fetch p95").result == "PASS"


def test_near_a_limit_warns_without_failing(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", seed=14)
    _peak_40_gib(run)
    set_monitor(run, max_memory_gib=42)
    res = report(run, tmp_path)
    assert check(res, "peak GPU memory").result == "WARN"
    assert res.verdicts[0][0] == "PASS" and "WARN: peak GPU memory 40.00 GiB within 10%" in res.verdicts[0][1]


def test_limits_profile_overrides_the_run(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", seed=15, tokens_per_s=1000.0)
    prof = tmp_path / "fast-box.yaml"
    prof.write_text(yaml.safe_dump({"name": "fast-box", "monitor": {"min_tokens_per_s": 50_000}}))
    out = tmp_path / "rep"
    res = runner.invoke(app, ["report", str(run), "--out", str(out), "--no-charts", "--limits", str(prof), "--json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    tps = next(c for c in data["runs"][0]["checks"] if c["name"] == "throughput")
    assert tps["result"] == "FAIL" and "--limits fast-box" in tps["limit"]
    assert data["runs"][0]["limits"]["min_tokens_per_s"] == {"value": 50_000, "source": "--limits fast-box"}
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump({"name": "bare"}))
    for bad, message in ((bare, "has no monitor: block"), (tmp_path / "nope", "profile '")):
        res = runner.invoke(app, ["report", str(run), "--out", str(out), "--no-charts", "--limits", str(bad)])
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.output


# -------------------------------------------------------------------------------------------- halts


def test_stale_watchdog_halt_is_fail_hung(tmp_path: Path) -> None:
    run = write_run(tmp_path / "hung", seed=21, end="halted", halt_reason=STALE)
    write_halt(run, STALE, rule="stale", evidence={"rank": 0, "age_s": 412.0, "step": 40})
    res = report(run, tmp_path)
    v, why = res.verdicts[0]
    assert v == "FAIL" and why.startswith("hung: the watchdog's stale-heartbeat rule halted the run at step 40")
    assert check(res, "halts").result == "FAIL"
    assert "**hung** (stale heartbeat)" in res.path.read_text()
    cli = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--no-charts"])
    assert cli.exit_code == 1 and "FAIL" in cli.stdout and "hung" in cli.stdout, cli.output
    # after a restart the .HALT is archived in halts/: still found, still FAIL
    (run / "halts").mkdir()
    (run / ".HALT").rename(run / "halts" / "HALT-20300101T000000-000001")
    assert report(run, tmp_path).verdicts[0][1].startswith("hung:")
    # no record left at all: the reason names the rule ("watchdog: stale: ..."), still hung
    (run / "halts" / "HALT-20300101T000000-000001").unlink()
    assert report(run, tmp_path).verdicts[0][1].startswith("hung:")
    # a reason of a watchdog from before the rule was part of it, without its record: a watchdog halt, rule unknown
    old = write_run(tmp_path / "old", seed=21, end="halted", halt_reason="watchdog: rank 0 heartbeat is 412 s old")
    assert report(old, tmp_path).verdicts[0] == ("FAIL", "watchdog rule `?` halted the run at step 40: watchdog: rank 0 "
                                                 "heartbeat is 412 s old (40/100 steps)")


def test_other_watchdog_halts_and_pending_ones_fail(tmp_path: Path) -> None:
    reason = "watchdog: data fetch p95 2500 ms > 2000 ms"
    run = write_run(tmp_path / "stall", seed=22, end="halted", halt_reason=reason)
    write_halt(run, reason, rule="fetch-stall")
    res = report(run, tmp_path)
    assert res.verdicts[0][0] == "FAIL" and "watchdog rule `fetch-stall` halted the run" in res.verdicts[0][1]
    assert "hung" not in res.verdicts[0][1]
    live = write_run(tmp_path / "live", seed=23, end=None)  # the watchdog wrote .HALT, the trainer has not acted yet
    write_halt(live, STALE, rule="stale")
    res = report(live, tmp_path)
    assert res.verdicts[0][0] == "FAIL" and "wrote .HALT, not acted on yet" in res.verdicts[0][1]
    assert "pending `.HALT` (not yet acted on) by watchdog" in res.path.read_text()


def test_operator_halt_is_not_fail(tmp_path: Path) -> None:
    run = write_run(tmp_path / "ops", seed=24, end="halted", halt_reason="node maintenance")
    write_halt(run, "node maintenance", who="ops@host (nsa halt)")
    res = report(run, tmp_path)
    assert res.verdicts[0] == ("PASS", "halted on request (node maintenance) at 40/100 steps, healthy until then")
    assert check(res, "halts").figure == "operator at step 40: node maintenance"
    text = res.path.read_text()
    assert "pending `.HALT`" not in text  # the trainer acted on it
    cli = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--no-charts"])
    assert cli.exit_code == 0 and "PASS" in cli.stdout, cli.output


# ------------------------------------------------------------------------------ environment, notes


def test_environment_section_shows_variables_with_secrets_redacted(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", seed=31)
    env = json.loads((run / "env.json").read_text())
    env["nsa_settings"]["NSA_API_TOKEN"] = "nsa-secret-1"
    env["environment"] = {
        "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "CUDA_VISIBLE_DEVICES": "0,1", "HF_TOKEN": "<redacted>", "NCCL_IB_KEY": "ib-secret-2",  # an old unredacted file
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    (run / "env.json").write_text(json.dumps(env))
    text = report(run, tmp_path).path.read_text()
    section = text.split("### Environment variables", 1)[1].split("### Training", 1)[0]
    for row in ("| `NCCL_DEBUG` | `INFO` |", "| `NCCL_SOCKET_IFNAME` | `eth0` |", "| `CUDA_VISIBLE_DEVICES` | `0,1` |",
                "| `PYTORCH_CUDA_ALLOC_CONF` | `expandable_segments:True` |", "| `NSA_ATTN_BACKEND` | `torch` |",
                "| `HF_TOKEN` | `<redacted>` |", "| `NCCL_IB_KEY` | `<redacted>` |", "| `NSA_API_TOKEN` | `<redacted>` |"):
        assert row in section, row
    assert "nsa-secret-1" not in text and "ib-secret-2" not in text


def test_notes_section(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", seed=32)
    notes = tmp_path / "deviations.md"
    notes.write_text("Deviations:\n\n1. batch 4 instead of 8 (OOM at 8)\n2. ran on node gpu-07\n")
    out = tmp_path / "rep"
    res = runner.invoke(app, ["report", str(run), "--out", str(out), "--no-charts", "--note", "restarted after reboot",
                              "--note", "loader warnings are expected", "--note-file", str(notes), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    text = Path(data["path"]).read_text()
    section = text.split("## Engineer's notes and deviations", 1)[1].split("## Run ", 1)[0]
    assert "- restarted after reboot\n- loader warnings are expected\n" in section
    assert "1. batch 4 instead of 8 (OOM at 8)\n2. ran on node gpu-07" in section
    assert data["notes"][0] == "restarted after reboot" and len(data["notes"]) == 3
    plain = runner.invoke(app, ["report", str(run), "--out", str(out), "--no-charts", "--json"])
    assert "None recorded" in Path(json.loads(plain.stdout)["path"]).read_text()
    piped = runner.invoke(app, ["report", str(run), "--out", str(out), "--no-charts", "--note-file", "-", "--json"],
                          input="GPU 3 swapped before the run\n")
    assert "- GPU 3 swapped before the run\n" in Path(json.loads(piped.stdout)["path"]).read_text(), piped.output
    res = runner.invoke(app, ["report", str(run), "--out", str(out), "--note-file", str(tmp_path / "missing.md")])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "note file" in lines[0] and "missing.md" in lines[0], res.output


# ------------------------------------------------------------------------------------------- charts


def _session_break(run: Path, at: int) -> None:
    """Make the run halt at step ``at`` and resume from its checkpoint (a second ``boot``) before going on."""
    hb = run / "heartbeat_rank0.jsonl"
    out = []
    for line in hb.read_text().splitlines():
        ev = json.loads(line)
        out.append(json.dumps(ev))
        if ev.get("event") == "progress" and ev["step"] == at:
            ck = str(run / "checkpoints" / f"step_{at:08d}")
            base = {"schema": 1, "rank": 0, "pid": os.getpid()}
            for extra in ({"event": "checkpoint", "ts": ev["ts"] + 0.1, "step": at, "path": ck, "seconds": 0.1, "reason": "halt"},
                          {"event": "halt", "ts": ev["ts"] + 0.2, "step": at, "reason": "ops", "source": "file", "checkpoint": ck},
                          {"event": "end", "ts": ev["ts"] + 0.3, "step": at, "status": "halted", "error": None},
                          {"event": "boot", "ts": ev["ts"] + 0.4, "step": 0, "run_name": run.name, "world_size": 1,
                           "local_rank": 0, "host": socket.gethostname(), "device": "cpu", "resumed_from": ck,
                           "steps_total": 100}):
                out.append(json.dumps({**base, **extra}))
    hb.write_text("\n".join(out) + "\n")


def test_charts_written_with_validation_points_and_markers(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", seed=41, steps=60)
    _session_break(run, 30)
    patch_progress(run, mem_allocated_mib=lambda s: 1000.0 + 10 * s, mem_reserved_mib=2048.0, mem_peak_mib=3000.0,
                   gate_entropy_mean=lambda s: 1.09 - s / 100)
    (run / "val.csv").write_text("step,val_loss,val_ppl\n" + "".join(
        f"{s},{5.0 - s / 30:.4f},{2.0:.4f}\n" for s in (15, 30, 45, 60)))
    set_monitor(run, max_memory_gib=4, min_tokens_per_s=500)
    res = build_report([run], tmp_path / "rep")
    charts = {c.name: c for _, c in res.charts}
    assert set(charts) == {"loss", "tokens_per_s", "memory", "gates", "fetch", "lr_grad"}
    for c in charts.values():
        data = c.path.read_bytes()
        assert data[:8] == PNG and len(data) > 5000 and c.path in res.images, c.path
    loss = charts["loss"]
    assert loss.series == {"training loss": 12, "validation loss": 4}
    assert loss.markers == {"checkpoint": 2, "halt": 1, "resume": 1}  # step 30 (halt) and the final step 60
    assert charts["memory"].series == {"GPU allocated": 12, "GPU reserved": 12, "GPU peak (allocator)": 12, "host RSS": 12}
    assert charts["gates"].panels == 3 and charts["lr_grad"].panels == 2
    assert charts["tokens_per_s"].series == {"tokens/s": 12, "rolling median": 12}
    text = res.path.read_text()
    for c in charts.values():
        assert f"]({c.path.relative_to(tmp_path / 'rep').as_posix()})" in text
    assert "- resumed at step 30 from" in text and "2 sessions" in text
    info = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--json"])
    loss_json = next(c for c in json.loads(info.stdout)["charts"] if c["name"] == "loss")
    assert loss_json["series"]["validation loss"] == 4 and loss_json["run"] == "run"
    none = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--no-charts", "--json"])
    assert json.loads(none.stdout)["images"] == [] and json.loads(none.stdout)["charts"] == []


def test_tokens_per_s_panels_when_scales_differ(tmp_path: Path) -> None:
    slow = write_run(tmp_path / "slow", seed=42, tokens_per_s=1000.0)
    fast = write_run(tmp_path / "fast", seed=43, tokens_per_s=9000.0)
    near = write_run(tmp_path / "near", seed=44, tokens_per_s=2000.0)
    res = build_report([slow, fast], tmp_path / "rep")
    combined = {c.name: c for run, c in res.charts if run is None}
    assert combined["tokens_per_s"].panels == 2 and combined["loss"].series["fast training loss"] == 8
    res = build_report([slow, near], tmp_path / "rep")
    combined = {c.name: c for run, c in res.charts if run is None}
    assert combined["tokens_per_s"].panels == 1 and combined["tokens_per_s"].path.read_bytes()[:8] == PNG
