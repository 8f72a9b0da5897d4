"""``nsa bench attention`` / ``nsa bench train`` in their CPU ``--tiny`` modes, and flag errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nsa_cli.app import app
from tests.test_train_process import _env

runner = CliRunner()


def test_bench_help_lists_commands() -> None:
    res = runner.invoke(app, ["bench", "--help"])
    assert res.exit_code == 0
    assert "attention" in res.output and "train" in res.output


def test_bench_attention_tiny(tmp_path: Path) -> None:
    out = tmp_path / "attn.json"
    res = runner.invoke(app, ["bench", "attention", "--tiny", "--seq-lens", "64", "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    assert "NSA vs dense attention" in res.output
    data = json.loads(out.read_text())
    assert data["command"] == "bench attention" and data["environment"]["torch"]
    (row,) = data["rows"]
    assert row["seq_len"] == 64 and row["shape"] == "tiny"
    assert row["nsa_fwd_ms"] > 0 and row["nsa_fwdbwd_ms"] > 0 and row["dense_fwd_ms"] > 0
    assert row["speedup_fwd"] > 0 and row["nsa_fwd_gflop"] > 0
    assert row["nsa_saved_mib"] > 0 and row["dense_saved_mib"] > 0  # what each forward keeps for its backward


def test_saved_mib_counts_what_the_forward_keeps_beyond_its_inputs() -> None:
    """Seed 0: ``x * y`` saves only its inputs (nothing counted); ``exp`` saves its new output, counted once;
    the outputs of later operations on its slices count as their own storages."""
    from nsa.bench.attention import saved_mib

    torch.manual_seed(0)
    x, y = (torch.randn(256, 1024, requires_grad=True) for _ in range(2))
    assert saved_mib(lambda: (x * y).sum(), [x, y]) == 0.0
    assert saved_mib(lambda: torch.exp(x), [x, y]) == pytest.approx(1.0)  # 256 x 1024 float32 = 1 MiB

    def twice() -> torch.Tensor:
        e = torch.exp(x)
        return e[:128].sigmoid().sum() + e[128:].tanh().sum()  # sigmoid/tanh save their outputs: 2 x 0.5 MiB

    assert saved_mib(twice, [x]) == pytest.approx(2.0)


def test_bench_attention_cuda_graph_flag_is_recorded(tmp_path: Path) -> None:
    """``--cuda-graph`` times CUDA-graph replays; on a CPU it is recorded as off and the times are plain."""
    out = tmp_path / "attn.json"
    res = runner.invoke(app, ["bench", "attention", "--tiny", "--seq-lens", "64", "--cuda-graph", "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(out.read_text())["rows"]
    assert row["cuda_graph"] is False and row["nsa_fwdbwd_ms"] > 0 and "CUDA graphs" not in res.output


def test_stage_rows_put_each_stage_against_its_roofline() -> None:
    """Paper shape at S=4096 with made-up stage times: FLOPs and bytes from ``stage_costs``, the roofline is
    the larger of FLOPs at the peak rate and bytes at the peak bandwidth, and the total adds the stages."""
    from nsa.bench.attention import stage_costs, stage_rows

    times = {"compress_avg": 0.05, "cmp_fwd": 0.4, "select": 0.3, "sel_fwd": 0.5, "win_fwd": 0.2}
    rows = stage_rows("paper", 4096, 64, 4, 128, times, peak_tflops=750, peak_tbps=3)
    assert [r.stage for r in rows] == [*times, "total"]
    costs = stage_costs(4096, 64, 4, 128, 128)
    for r in rows[:-1]:
        flops, nbytes = costs[r.stage]
        assert r.roofline_ms == max(flops / 750e9, nbytes / 3e9)
        assert r.bound == ("compute" if flops / 750e9 >= nbytes / 3e9 else "memory")
        assert r.tflops == flops / 1e9 / times[r.stage] and r.of_roofline == r.roofline_ms / times[r.stage]
    assert rows[0].bound == "memory" and rows[0].gflop == 0  # compression is a pure read/write
    assert rows[2].bound == "memory"  # block scoring at 4k: reading q outweighs S x S/16 products per head...
    (long,) = [r for r in stage_rows("paper", 65536, 64, 4, 128, {"select": 3.0}) if r.stage == "select"]
    assert long.bound == "compute"  # ...and at 64k the products win
    total = rows[-1]
    assert abs(total.ms - sum(times.values())) < 1e-12
    assert abs(total.roofline_ms - sum(r.roofline_ms for r in rows[:-1])) < 1e-12
    # the compressed stages say which kernel ran them; the others have one kernel each
    paths = {r.stage: r.path for r in stage_rows("paper", 4096, 64, 4, 128, times, cmp_path="cudnn")}
    assert paths == {"compress_avg": "", "cmp_fwd": "cudnn", "select": "", "sel_fwd": "", "win_fwd": "", "total": ""}


def test_bench_attention_stages_need_the_triton_kernels() -> None:
    res = runner.invoke(app, ["bench", "attention", "--tiny", "--stages"])
    assert res.exit_code == 2 and "--stages times the Triton kernels" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.slow
def test_bench_train_over_two_context_ranks(tmp_path: Path) -> None:
    """``--nproc-per-node 2 --context-parallel 2`` on two gloo ranks: one row per attention with the layout,
    tokens/s counting each sequence once (batch 2 x 64 positions over the slowest rank's step)."""
    out = tmp_path / "train.json"
    res = subprocess.run([sys.executable, "-m", "nsa_cli", "bench", "train", "--tiny", "--attention", "nsa",
                          "--nproc-per-node", "2", "--context-parallel", "2", "--json-out", str(out)],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "ranks 2 (1 data x 2 context)" in res.stdout + res.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["world_size"] == 2 and row["context_parallel"] == 2 and row["parallel"] == "ddp"
    assert row["tokens_per_s"] == pytest.approx(2 * 64 / (row["step_ms"] / 1e3))
    assert row["tokens_per_s_per_gpu"] == pytest.approx(row["tokens_per_s"] / 2)


def test_bench_train_rank_flags_that_cannot_work_are_one_line() -> None:
    for args, want in (
        (["--tiny", "--context-parallel", "2"], "needs ranks to share the sequence"),
        (["--tiny", "--nproc-per-node", "3", "--context-parallel", "2"], "must divide --nproc-per-node 3"),
        (["--seq-lens", "30", "--batch-sizes", "1", "--nproc-per-node", "2", "--context-parallel", "2"],
         "must split into 4 equal chunks"),
    ):
        res = runner.invoke(app, ["bench", "train", *args])
        assert res.exit_code == 2 and want in res.output, (args, res.output)
        assert len(res.output.strip().splitlines()) == 1, res.output


def test_bench_train_tiny(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    res = runner.invoke(app, ["bench", "train", "--tiny", "--trace-dir", str(tmp_path / "traces"), "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    rows = {r["attention"]: r for r in data["rows"]}
    assert set(rows) == {"nsa", "dense"}
    for r in rows.values():
        assert r["seq_len"] == 64 and r["tokens_per_s"] > 0 and r["step_ms"] > 0
    assert rows["nsa"]["params_m"] > rows["dense"]["params_m"]  # separate branch projections and gates
    assert data["nsa_over_dense"]["S=64 b=2 eager"] > 0
    assert all(r["compiled"] is False and r["error"] is None and r["flops_per_token"] > 0 for r in rows.values())
    assert "MFU: mfu = tokens_per_s" in res.output and "nsa eager S=64 b=2:" in res.output  # progress lines
    # --trace-dir (implies --profile-step): one more step profiled (on a CPU: operators by self time), its trace kept
    assert all(r["launches"] > 0 and r["kernels"] and r["kernels"][0]["ms"] >= 0 for r in rows.values())
    assert "profile (nsa eager, S=64)" in res.output
    for att in ("nsa", "dense"):
        assert json.loads((tmp_path / "traces" / f"{att}-S64-eager-rank0.json").read_text())["traceEvents"]


def test_bench_flag_errors_are_one_line() -> None:
    """Each bad value is refused in one line that names its flag (exit 2)."""
    for args, flag in ((["bench", "attention", "--tiny", "--seq-lens", "abc"], "--seq-lens"),
                       (["bench", "attention", "--tiny", "--shape", "5,2,16"], "--shape"),
                       (["bench", "attention", "--tiny", "--tune", "sel_bm"], "--tune"),
                       (["bench", "attention", "--tiny", "--tune", "sel_bmx=16"], "--tune sel_bmx"),
                       (["bench", "train", "--tiny", "--modes", "fast"], "--modes"),
                       (["bench", "train", "--tiny", "--attention", "sparse"], "--attention")):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], (args, res.output)


def test_bench_retrieval_writes_curves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A few steps of the retrieval benchmark on the CPU: the table, and one curve per variant in JSON; the NSA
    model trains with the config's selection losses (the default alignment loss), the window control without."""
    from nsa.bench import retrieval as bench_retrieval
    from nsa.model.diagnostics import ScorerParams
    from nsa.model.lm import NSALM

    configured: list[object] = []
    real = NSALM.__init__
    monkeypatch.setattr(NSALM, "__init__", lambda self, *a, **k: (configured.append(k.get("scorer")),
                                                                   real(self, *a, **k))[1])
    variants: list[str] = []
    learn = bench_retrieval.learn_retrieval
    monkeypatch.setattr(bench_retrieval, "learn_retrieval",
                        lambda *a, **k: (variants.append(a[3]), learn(*a, **k))[1])
    out = tmp_path / "retrieval.json"
    res = runner.invoke(app, ["bench", "retrieval", "--config", "tiny", "--seq-len", "64", "--gap", "20", "--steps", "4",
                              "--eval-every", "2", "--eval-samples", "8", "--variants", "nsa,window", "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    assert variants == ["nsa", "window"] and configured == [ScorerParams(64, 0.0, "query_and_keys", 0.1), None]  # nsa's only
    assert json.loads(out.read_text())["scorer"]["align"] == 0.1
    assert "retrieval at S=64" in res.output
    data = json.loads(out.read_text())
    assert data["command"] == "bench retrieval" and data["environment"]["torch"] and data["gap"] == 20
    curves = {c["variant"]: c for c in data["curves"]}
    assert set(curves) == {"nsa", "window"}
    assert [p["step"] for p in curves["nsa"]["points"]] == [2, 4]
    assert curves["window"]["points"][-1]["gates"] == [0.0, 0.0, 1.0]
    assert len(curves["nsa"]["points"][-1]["gates"]) == 3


def test_bench_retrieval_flag_errors_are_one_line() -> None:
    for args, text in ((["--variants", "sparse"], "--variants"), (["--seeds", "a"], "--seeds"),
                       (["--config", "tiny", "--seq-len", "64", "--gap", "62"], "gap=62")):
        res = runner.invoke(app, ["bench", "retrieval", *args])
        assert res.exit_code == 2, (args, res.output)
        assert "error:" in res.output and text in res.output


def test_bench_train_runs_the_trainers_selection_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nsa bench train`` times the step ``nsa train`` runs: the model gets the trainer's scorer arguments
    (the default recipe's alignment loss on; both weights per micro-batch under ``train.accum``)."""
    from nsa.bench.train import bench_train_step
    from nsa.config import load_run_config
    from nsa.model.diagnostics import ScorerParams
    from nsa.model.lm import NSALM

    seen: list[object] = []
    real = NSALM.__init__
    monkeypatch.setattr(NSALM, "__init__", lambda self, *a, **k: (seen.append(k.get("scorer")), real(self, *a, **k))[1])
    cfg = load_run_config("tiny", environ={}, sets=["scorer.weight=0.2", "train.accum=4"]).config
    assert ScorerParams.of_config(cfg.scorer, 4) == ScorerParams(64, 0.05, "query_and_keys", 0.025)
    off = cfg.scorer.model_copy(update={"weight": 0.0, "align": 0.0})
    assert ScorerParams.of_config(off) == ScorerParams(0, 0.0, "query_and_keys", 0.0)
    row = bench_train_step(cfg, attention="nsa", seq_len=64, batch_size=2, steps=1, warmup=0, device="cpu")
    assert row.error is None and seen == [ScorerParams(64, 0.2, "query_and_keys", 0.1)]  # one step is one micro-batch


def test_bench_train_pairs_each_variant_in_its_own_compile_mode() -> None:
    """With ``runtime.compile_mode=auto`` NSA runs under CUDA graphs and dense under the default mode: the table
    says which, and the NSA/dense ratio still pairs the two compiled rows."""
    from nsa.bench.train import TrainRow, speedups

    def row(attention: str, tps: float, mode: str | None, compiled: bool = True) -> TrainRow:
        return TrainRow(attention=attention, seq_len=2048, batch_size=16, params_m=1.0, step_ms=1.0,
                        tokens_per_s=tps, peak_mib=None, device="cpu", backend="triton", compiled=compiled,
                        compile_mode=mode)

    rows = [row("nsa", 300.0, "reduce-overhead"), row("dense", 600.0, "default"),
            row("nsa", 100.0, None, compiled=False), row("dense", 400.0, None, compiled=False)]
    assert [r.mode for r in rows] == ["compiled (reduce-overhead)", "compiled", "eager", "eager"]
    assert speedups(rows) == {"S=2048 b=16 compiled": 0.5, "S=2048 b=16 eager": 0.25}


def test_bench_train_and_nsa_train_run_one_step_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 54: the benchmark times the trainer's step (``nsa.train.step.Stepper``), optimizer and schedule
    included: both call the same ``forward_backward`` and ``apply``, and the bench's optimizer is the run's."""
    from nsa.bench.train import bench_train_step
    from nsa.config import load_run_config
    from nsa.train.step import Stepper

    calls: list[tuple[str, int]] = []
    real_fb, real_apply = Stepper.forward_backward, Stepper.apply

    def fb(self: Stepper) -> object:
        calls.append(("forward_backward", len(self.optimizer.param_groups)))
        return real_fb(self)

    def apply(self: Stepper) -> None:
        calls.append(("apply", len(self.optimizer.param_groups)))
        real_apply(self)

    monkeypatch.setattr(Stepper, "forward_backward", fb)
    monkeypatch.setattr(Stepper, "apply", apply)
    cfg = load_run_config("tiny", environ={}).config
    row = bench_train_step(cfg, attention="nsa", seq_len=64, batch_size=2, steps=2, warmup=1, device="cpu")
    assert row.error is None
    # warm-up, the timed steps: each one forward/backward and one apply, with the run's two AdamW groups
    assert calls[:2] == [("forward_backward", 2), ("apply", 2)] and len(calls) >= 6
    calls.clear()
    res = runner.invoke(app, ["train", "--config", "tiny", "--steps", "3", "--out-dir", str(tmp_path / "run"),
                              "--set", "eval.every=0"])
    assert res.exit_code == 0, res.output
    assert calls == [("forward_backward", 2), ("apply", 2)] * 3
