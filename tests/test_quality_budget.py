"""``nsa bench quality --budget``: arms at equal tokens and at equal GPU time, the step budget's parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nsa.bench.quality import ARMS, QualitySpec, arm_phases
from nsa.bench.step_parts import OTHER, part_of, parts_of
from nsa_cli.app import app

runner = CliRunner()


def _spec(budget: str, **kw: object) -> QualitySpec:
    spec = QualitySpec("tiny", [], [ARMS["dense"], ARMS["nsa"]], [0, 1], 100, Path("/nonexistent"), budget=budget,
                       **kw)  # type: ignore[arg-type]
    spec.step_ms = {"dense": 40.0, "nsa": 100.0}
    return spec


def test_equal_time_gives_each_arm_the_reference_arms_gpu_time() -> None:
    """The slowest arm is the reference: it keeps the steps, a 2.5x faster arm gets 2.5x as many; under ``both`` the
    reference's equal-time run is its equal-token run (not run twice); a named reference scales the others down."""
    spec = _spec("both")
    assert spec.reference() == "nsa" and spec.time_steps() == {"dense": 250, "nsa": 100}
    runs = [(r.arm.name, r.seed, r.steps, r.budget) for r in spec.runs()]
    assert runs == [("dense", 0, 100, "tokens"), ("nsa", 0, 100, "tokens"), ("dense", 1, 100, "tokens"),
                    ("nsa", 1, 100, "tokens"), ("dense", 0, 250, "time"), ("dense", 1, 250, "time")]
    named = _spec("time", time_reference="dense")
    assert named.time_steps() == {"dense": 100, "nsa": 40}
    assert {(r.arm.name, r.steps) for r in named.runs()} == {("dense", 100), ("nsa", 40)}  # time alone: all run
    swept = _spec("time", lrs=[5e-4, 1e-3])  # every rate of an arm gets the arm's steps
    assert {(r.arm.name, r.steps) for r in swept.runs()} == {("dense@lr=0.0005", 250), ("dense@lr=0.001", 250),
                                                           ("nsa@lr=0.0005", 100), ("nsa@lr=0.001", 100)}


def test_a_curriculum_arms_step_is_the_mean_of_its_phases() -> None:
    """``nsa-ladder``: a quarter of the steps at 16x shorter windows, a quarter at 4x, half at the full length."""
    phases = arm_phases("tiny", ["train.seq_len=256", "train.batch_size=2"], ARMS["nsa-ladder"])
    assert [f for f, _ in phases] == [0.25, 0.25, 0.5]
    assert "train.seq_len=16" in phases[0][1] and "train.batch_size=32" in phases[0][1]
    assert "train.seq_len=64" in phases[1][1] and phases[2][1] == list(ARMS["nsa-ladder"].sets)


def test_bench_quality_both_budgets_end_to_end(tmp_path: Path) -> None:
    """Each arm's step probed alone, then the equal-token runs and the equal-time ones: the faster arm trains the
    steps its probed step buys in the reference's GPU time, every row says its budget, the JSON marks the
    equal-time readings, a second chart draws them against GPU seconds, and the saved sweep reads back."""
    out, chart = tmp_path / "q.json", tmp_path / "q.png"
    res = runner.invoke(app, ["bench", "quality", "--tiny", "--arms", "dense,nsa-half", "--steps", "4", "--budget",
                              "both", "--time-reference", "nsa-half", "--probe-steps", "2", "--set",
                              "train.seq_len=64", "-o", str(tmp_path / "runs"), "--json-out", str(out),
                              "--chart", str(chart)])
    assert res.exit_code == 0, res.output
    payload = json.loads(out.read_text())
    timed = payload["equal_time"]
    assert payload["budget"] == "both" and timed["reference"] == "nsa-half" and timed["reference_steps"] == 4
    ms, steps = timed["step_ms"], timed["steps"]
    assert set(ms) == {"dense", "nsa-half"} and all(v > 0 for v in ms.values())
    assert steps == {"dense": max(1, round(4 * ms["nsa-half"] / ms["dense"])), "nsa-half": 4}
    rows = {(r["arm"], r["budget"]): r for r in payload["rows"]}
    assert set(rows) == {("dense", "tokens"), ("nsa-half", "tokens"), ("dense", "time"), ("nsa-half", "time")}
    assert rows[("dense", "time")]["steps"] == steps["dense"] and rows[("dense", "tokens")]["steps"] == 4
    assert rows[("dense", "time")]["gpu_seconds"] == pytest.approx(steps["dense"] * ms["dense"] / 1e3)
    assert rows[("nsa-half", "time")]["val_loss"] == rows[("nsa-half", "tokens")]["val_loss"]  # the same run
    cfg = yaml.safe_load((tmp_path / "runs" / "dense" / "time-seed0" / "config.yaml").read_text())
    assert cfg["train"]["steps"] == steps["dense"] and cfg["train"]["run_name"] == "dense-time-seed0"
    assert {a["arm"] for a in timed["arms_summary"]} == {"dense", "nsa-half"}
    assert {a["arm"] for a in payload["arms_summary"]} == {"dense", "nsa-half"}
    words = " ".join(res.output.split())  # the tables' titles wrap
    assert "mean +- sd): equal tokens" in words and "mean +- sd): equal GPU time" in words
    assert chart.is_file() and (tmp_path / "q-time.png").is_file()
    back = runner.invoke(app, ["bench", "quality", "--from", str(out), "--json"])
    assert back.exit_code == 0, back.output
    again = json.loads(back.stdout)
    assert again["equal_time"]["steps"] == steps and len(again["rows"]) == 4


@pytest.mark.parametrize("argv, says", [
    (["--budget", "weekly"], "--budget 'weekly' must be one of tokens, time, both"),
    (["--budget", "time", "--task", "needle"], "--budget time applies to --task text"),
    (["--budget", "time", "--time-reference", "bogus"], "--time-reference 'bogus' is not one of the arms"),
])
def test_bench_quality_budget_flags_that_cannot_work_are_one_line(tmp_path: Path, argv: list[str], says: str) -> None:
    res = runner.invoke(app, ["bench", "quality", "--tiny", *argv, "-o", str(tmp_path)])
    assert res.exit_code == 2 and says in res.output and "Traceback" not in res.output
    assert not any(tmp_path.iterdir())  # nothing trained


def test_step_parts_put_each_kernel_in_one_part() -> None:
    names = {
        "_sel_fsa_bwd_kernel": "nsa selected", "_range_bwd_dkdv_kernel": "nsa compressed/window (range kernels)",
        "_block_scores_kernel": "nsa block scores + top-n", "_to_virtual_kernel": "nsa layout copies",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": "attention library (cuDNN/flash)",
        "void at::native::(anonymous namespace)::radixSortKVInPlace": "sorts and scans",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN": "GEMM", "triton_poi_fused_add_mul_0": "fused elementwise (Inductor)",
        "void at::native::multi_tensor_apply_kernel": "optimizer", "Memset (Device)": "memcpy/memset",
        "something_else": OTHER,
    }
    for name, part in names.items():
        assert part_of(name) == part, name
    parts = parts_of([("_sel_fsa_fwd_kernel", 2.0, 3), ("_sel_merge_kernel", 1.5, 3), ("nvjet_x", 4.0, 10)])
    assert parts == {"GEMM": 4.0, "nsa selected": 3.5, "launches": 16.0}
    assert list(parts)[:2] == ["GEMM", "nsa selected"]  # largest first
