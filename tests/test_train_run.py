"""In-process training runs: the run directory, its documented schema, .HALT, NaN injection, loader
position and bad-record accounting. Tiny shapes (seq 32, batch 2) so each run takes seconds."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from nsa.config import load_run_config
from nsa.errors import ConfigError
from nsa.rundir.checkpoints import latest_checkpoint, list_checkpoints
from nsa.rundir.records import COMMON_FIELDS, EVENT_FIELDS, TRAIN_CSV_HEADER, VAL_CSV_HEADER
from nsa.train.checkpoint import load_state
from nsa.train.trainer import Trainer
from tests.conftest import cli_trainer_hook, csv_rows, events, halt_at, nan_loss_at, quiet, resolve, signal_at

DOC = Path(__file__).resolve().parent.parent / "docs" / "run-directory.md"


def documented_events() -> dict[str, set[str]]:
    """The heartbeat table of docs/run-directory.md: ``| `event` | field, field, ... | notes |``."""
    text = DOC.read_text()
    section = text.split("## Heartbeat schema", 1)[1]
    out = {}
    for line in section.splitlines():
        m = re.match(r"^\|\s*`([a-z-]+)`\s*\|([^|]*)\|", line)
        if m:
            out[m.group(1)] = {f.strip().strip("`") for f in m.group(2).split(",") if f.strip()}
    return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    r = resolve(out, 16, checkpoint__every=8, eval__every=8, checkpoint__keep_last=1)
    result = Trainer(r, reporter=quiet()).fit()
    assert result.status == "completed" and result.steps_done == 16 and result.run_dir == out
    return out


def test_run_directory_is_complete(full_run: Path) -> None:
    names = {p.name for p in full_run.iterdir()}
    for required in ("config.yaml", "env.json", "training.csv", "val.csv", "heartbeat_rank0.jsonl",
                     "metrics.json", "tb", "checkpoints", "export"):
        assert required in names, required
    assert [p.name for p in list_checkpoints(full_run)] == ["step_00000016"]  # keep_last=1 pruned step 8
    assert not [p for p in (full_run / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert list((full_run / "tb").glob("events.out.tfevents.*"))
    assert {p.name for p in (full_run / "export").iterdir()} == {"model.safetensors", "config.yaml", "tokenizer.json",
                                                             "export.json"}
    cfg = yaml.safe_load((full_run / "config.yaml").read_text())
    assert cfg["train"]["steps"] == 16 and cfg["train"]["seq_len"] == 32 and set(cfg) == {"model", "nsa", "runtime", "train", "optimizer", "schedule", "checkpoint", "logging", "eval", "scorer", "data", "monitor"}
    assert "# _sources" in (full_run / "config.yaml").read_text()
    env = json.loads((full_run / "env.json").read_text())
    for key in ("versions", "device", "driver", "git", "nsa_settings", "environment"):
        assert key in env
    assert env["versions"]["torch"] == torch.__version__ and set(env["git"]) >= {"commit", "branch", "dirty"}


def test_csv_files_have_headers(full_run: Path) -> None:
    with open(full_run / "training.csv") as f:
        assert tuple(next(csv.reader(f))) == TRAIN_CSV_HEADER
    rows = csv_rows(full_run / "training.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 17))
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    with open(full_run / "val.csv") as f:
        assert tuple(next(csv.reader(f))) == VAL_CSV_HEADER
    assert [int(r["step"]) for r in csv_rows(full_run / "val.csv")] == [8, 16]


def test_heartbeat_matches_documented_schema(full_run: Path) -> None:
    doc = documented_events()
    assert set(doc) == set(EVENT_FIELDS)
    for name, fields in EVENT_FIELDS.items():
        assert doc[name] == set(fields), f"docs/run-directory.md and the trainer disagree on '{name}'"
    evs = events(full_run)
    kinds = [e["event"] for e in evs]
    assert kinds[0] == "boot" and kinds[1] == "loader-ready" and kinds[-1] == "end"
    assert {"progress", "eval", "checkpoint"} <= set(kinds)
    for e in evs:
        assert set(e) == set(COMMON_FIELDS) | set(EVENT_FIELDS[e["event"]]), e["event"]
        assert e["schema"] == 1 and e["rank"] == 0
    progress = [e for e in evs if e["event"] == "progress"]
    assert progress[-1]["step"] == 16 and progress[-1]["tokens_seen"] == 16 * 2 * 32
    assert len(progress[-1]["gate_branch_shares"]) == 3 and progress[-1]["gate_entropy_mean"] > 0
    assert progress[-1]["fetch_p50_ms"] is not None and isinstance(progress[-1]["fallback"], dict)
    assert evs[-1]["status"] == "completed"


def test_metrics_and_export(full_run: Path) -> None:
    m = json.loads((full_run / "metrics.json").read_text())
    assert m["status"] == "completed" and m["steps_done"] == 16 and m["tokens_seen"] == 16 * 64
    assert m["tokens_per_s"] > 0 and "peak" in m["mfu_formula"] and m["mfu_peak_source"]
    from safetensors.torch import load_model

    from nsa.model import build_model

    cfg = load_run_config(full_run / "export" / "config.yaml", environ={}).config
    model = build_model(cfg)
    load_model(model, str(full_run / "export" / "model.safetensors"))
    state = load_state(latest_checkpoint(full_run))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state["model"][name]), name


def test_loss_falls(full_run: Path) -> None:
    losses = [float(row["loss"]) for row in csv_rows(full_run / "training.csv")]
    assert len(losses) == 16 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-4:]) / 4 < sum(losses[:3]) / 3 - 0.5, losses


def test_halt_file_then_resume_archives_stale_halt(tmp_path: Path) -> None:
    run = tmp_path / "run"
    hook = halt_at(run, 2, json.dumps({"reason": "operator test", "who": "pytest"}))
    result = Trainer(resolve(run, 40, checkpoint__every=0), reporter=quiet(), step_hook=hook).fit()
    assert result.status == "halted" and result.steps_done == 3  # written after step 2, read during step 3
    evs = events(run)
    halt = next(e for e in evs if e["event"] == "halt")
    assert halt["source"] == "file" and halt["reason"] == "operator test"
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and halt["checkpoint"] == str(ckpt) and ckpt.name == f"step_{result.steps_done:08d}"
    assert evs[-1]["event"] == "end" and evs[-1]["status"] == "halted"
    assert json.loads((run / "metrics.json").read_text())["status"] == "halted"
    # the .HALT acted on is retired into halts/ (issue 34: it no longer warns on every resume)
    assert not (run / ".HALT").exists()
    (retired,) = list((run / "halts").iterdir())
    assert retired.name.endswith("-acted") and "operator test" in retired.read_text()

    # resume: a .HALT written while no trainer ran is archived, not obeyed
    (run / ".HALT").write_text("written while stopped")
    out = quiet()
    resumed = Trainer(resolve(run, result.steps_done + 2, train__resume="auto", checkpoint__every=0), reporter=out).fit()
    assert resumed.status == "completed" and resumed.steps_done == result.steps_done + 2
    assert not (run / ".HALT").exists() and "stale .HALT" in out.text()
    archived = sorted((run / "halts").iterdir())
    assert len(archived) == 2 and "written while stopped" in (set(archived) - {retired}).pop().read_text()
    steps = [int(r["step"]) for r in csv_rows(run / "training.csv")]
    assert steps == list(range(1, result.steps_done + 3))
    # resuming a finished run changes nothing and completes at once
    again = Trainer(resolve(run, result.steps_done + 2, train__resume="auto"), reporter=quiet()).fit()
    assert again.status == "completed" and again.steps_done == result.steps_done + 2
    assert again.metrics["steps_this_session"] == 0


def test_nan_injection_halts_with_last_good_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nsa_cli.app import app

    run = tmp_path / "run"
    cli_trainer_hook(monkeypatch, nan_loss_at(5))  # the loss of step 5 becomes NaN
    args = ["train", "--config", "tiny", "--steps", "6", "--seq-len", "32", "--batch-size", "2", "--out-dir", str(run),
            "--set", "checkpoint.every=2", "--set", "logging.every=1", "--set", "eval.every=0"]
    res = CliRunner().invoke(app, args, env={})
    assert res.exit_code == 1, res.output
    assert [p.name for p in list_checkpoints(run)][-1] == "step_00000004"
    record = json.loads((run / "anomalies" / "step_5.json").read_text())
    assert record["kind"] == "nonfinite_loss" and record["applied"] is False and record["fault_injected"] is True
    evs = events(run)
    kinds = [e["event"] for e in evs]
    assert kinds[-3:] == ["anomaly", "halt", "end"]
    assert evs[-3]["value"] == "nan" and evs[-3]["record"] == "anomalies/step_5.json"  # text, not null; in the run
    assert evs[-2]["source"] == "anomaly" and evs[-2]["checkpoint"].endswith("step_00000004")
    assert evs[-1]["status"] == "failed"
    assert [int(r["step"]) for r in csv_rows(run / "training.csv")] == [1, 2, 3, 4]
    assert json.loads((run / "metrics.json").read_text())["status"] == "failed"
    # the last good checkpoint is intact and resumable
    state = load_state(latest_checkpoint(run))
    assert state["train_state"]["step"] == 4 and all(torch.isfinite(t).all() for t in state["model"].values())


def test_loader_position_round_trip(tmp_path: Path) -> None:
    from nsa.data.loader import build_loader
    from nsa.data.tokenizers import get_tokenizer

    run = tmp_path / "run"
    r = resolve(run, 3, train__accum=2, checkpoint__every=3, eval__every=0)
    Trainer(r, reporter=quiet()).fit()
    state = load_state(latest_checkpoint(run))
    assert len(state["loader"]) == 1 and state["loader"][0]["batches"] == 6
    cfg = r.config
    tok = get_tokenizer(cfg.data.tokenizer, None)
    kw = dict(seq_len=32, batch_size=2, seed=cfg.train.seed, rank=0, world_size=1, split="train")
    with build_loader(cfg.data, tok, **kw) as restored, build_loader(cfg.data, tok, **kw) as fresh:
        restored.load_state_dict(state["loader"][0])
        for _ in range(6):
            next(fresh)
        for _ in range(3):
            a, b = next(restored), next(fresh)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bad_records_are_counted(tmp_path: Path) -> None:
    rows = [{"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 5 + 2)} for i in range(30)]
    rows[0] = {"text": ""}
    rows[1] = {"text": 42}
    rows[2] = {"title": "no text"}
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    r = resolve(run, 4, data__source="local", data__path=str(data), data__val_fraction=0.0,
                eval__every=0, checkpoint__every=0)
    assert Trainer(r, reporter=quiet()).fit().status == "completed"
    skipped = json.loads((run / "metrics.json").read_text())["data"]["skipped"]
    assert skipped.get("empty", 0) >= 1 and skipped.get("not_str", 0) >= 1 and skipped.get("missing_field", 0) >= 1
    last = [e for e in events(run) if e["event"] == "progress"][-1]
    assert last["data_skipped"]["total"] >= 3


def test_resume_with_another_model_is_refused_before_work(full_run: Path) -> None:
    from nsa.errors import CheckpointError

    before = (full_run / "heartbeat_rank0.jsonl").read_text()
    with pytest.raises(CheckpointError, match=r"model\.dim"):
        Trainer(resolve(full_run, 20, train__resume="auto", model__dim=32), reporter=quiet())
    assert (full_run / "heartbeat_rank0.jsonl").read_text() == before


@pytest.mark.gpu
def test_gpu_bf16_run_reports_memory_and_mfu(tmp_path: Path) -> None:
    r = resolve(tmp_path / "run", 6, runtime__device="cuda", runtime__precision="auto",
                runtime__deterministic=False, checkpoint__every=3, eval__every=3)
    result = Trainer(r, reporter=quiet()).fit()
    assert result.status == "completed"
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["precision"] == "bf16" and m["memory"]["mem_peak_mib"] > 0
    last = [e for e in events(tmp_path / "run") if e["event"] == "progress"][-1]
    assert last["mem_allocated_mib"] > 0 and last["mem_reserved_mib"] >= last["mem_allocated_mib"]
    if m["mfu_peak_flops_per_device"] is not None:
        assert 0 < last["mfu"] < 1


def test_synthetic_fallback_is_recorded_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    run = tmp_path / "run"
    r = resolve(run, 2, data__source="fineweb_edu", data__hf_dataset="nsa-test/not-a-dataset",
                data__synthetic_on_fail=True, data__timeout_s=30, eval__every=0, checkpoint__every=0)
    console = quiet()
    assert Trainer(r, reporter=console).fit().status == "completed"
    assert "WARNING" in console.text() and "SYNTHETIC" in console.text()
    ready = next(e for e in events(run) if e["event"] == "loader-ready")
    assert ready["warnings"] and "SYNTHETIC" in ready["warnings"][0]
    assert [e for e in events(run) if e["event"] == "progress"][-1]["data_warnings"] == ready["warnings"]
    assert json.loads((run / "env.json").read_text())["data_warnings"] == ready["warnings"]
    assert json.loads((run / "metrics.json").read_text())["data_warnings"] == ready["warnings"]
    assert ready["source"] == "fineweb_edu" and ready["source_used"] == "synthetic"
    from nsa.runs.report import (
        build_report,  # issue 26: the report and the watch say it, the verdict takes it
    )

    res = build_report([run], tmp_path / "rep", charts=False)
    assert res.verdicts[0][0] == "FAIL" and "trained on synthetic data" in res.verdicts[0][1]
    from nsa_cli.app import app

    once = CliRunner().invoke(app, ["watch", str(run), "--once"])
    assert once.exit_code == 1 and "data-fallback" in once.output and "SYNTHETIC" in once.output


def test_resume_accepts_another_number_of_ranks_before_launch(tmp_path: Path) -> None:
    """A checkpoint of 2 ranks passes the checks made before torchrun starts on 2, and those of a run on 1
    (it reshards at load: tests/test_parallel.py); the model section must still match."""
    from nsa.errors import CheckpointError
    from nsa.train.checkpoint import save_checkpoint

    run = tmp_path / "run"
    r = resolve(run, 4, train__resume="auto")
    sections = r.config.model_dump(mode="json")
    save_checkpoint(run, 2, {"w": torch.randn(2)}, {"world_size": 2, "model": sections["model"], "nsa": sections["nsa"]})
    assert Trainer(r, reporter=quiet(), world_size=2).resume_from is not None
    assert Trainer(r, reporter=quiet()).resume_from is not None
    other = resolve(run, 4, train__resume="auto", model__dim=32)
    with pytest.raises(CheckpointError):
        Trainer(other, reporter=quiet())


def test_sigterm_halts_like_the_halt_file(tmp_path: Path) -> None:
    """SIGTERM (sent to this process while it trains in the main thread) checkpoints and halts."""
    import signal

    run = tmp_path / "run"
    previous = signal.getsignal(signal.SIGTERM)
    result = Trainer(resolve(run, 40, checkpoint__every=0, eval__every=0), reporter=quiet(),
                     step_hook=signal_at(2, signal.SIGTERM)).fit()
    assert signal.getsignal(signal.SIGTERM) is previous  # handlers are removed after the run
    assert result.status == "halted" and result.steps_done == 3  # sent after step 2, acted on in step 3
    evs = events(run)
    assert [e["event"] for e in evs[-3:]] == ["checkpoint", "halt", "end"]
    assert evs[-2]["source"] == "SIGTERM" and evs[-3]["reason"] == "halt"
    assert latest_checkpoint(run).name == f"step_{result.steps_done:08d}"


def test_resume_of_a_checkpoint_from_before_the_gate_fields_names_the_sets(tmp_path: Path) -> None:
    """A checkpoint saved before ``nsa.gate_bias``/``nsa.gate_scale`` existed was trained with the old
    gates (bias 0, scale 1): resuming with today's defaults is refused with the ``--set`` that matches."""
    from nsa.errors import CheckpointError
    from nsa.train.checkpoint import save_checkpoint

    run = tmp_path / "run"
    r = resolve(run, 4, train__resume="auto")
    sections = r.config.model_dump(mode="json")
    old_nsa = {k: v for k, v in sections["nsa"].items() if k not in ("gate_bias", "gate_scale")}
    save_checkpoint(run, 2, {"w": torch.randn(2)}, {"world_size": 1, "model": sections["model"], "nsa": old_nsa})
    with pytest.raises(CheckpointError, match=r"nsa\.gate_bias, nsa\.gate_scale") as err:
        Trainer(r, reporter=quiet())
    assert err.value.hint is not None
    assert "--set nsa.gate_bias=[0.0,0.0,0.0]" in err.value.hint and "--set nsa.gate_scale=1.0" in err.value.hint
    legacy = resolve(run, 4, train__resume="auto", nsa__gate_bias=[0.0, 0.0, 0.0], nsa__gate_scale=1.0)
    Trainer(legacy, reporter=quiet())  # the old gates: accepted


def test_resume_of_a_run_with_the_former_default_gates_names_the_set(tmp_path: Path) -> None:
    """Runs started before issue 24 saved the slow gates ``(-2, -2, -2)`` and no ``nsa.gate_init``: resuming
    one with today's default (window) is refused with the ``--set`` of its bias; ``gate_init`` is only a
    name for a bias, so ``--set nsa.gate_init=slow`` resumes it as well."""
    from nsa.errors import CheckpointError
    from nsa.train.checkpoint import save_checkpoint

    run = tmp_path / "run"
    r = resolve(run, 4, train__resume="auto")
    sections = r.config.model_dump(mode="json")
    old_nsa = {k: v for k, v in sections["nsa"].items() if k != "gate_init"}
    old_nsa["gate_bias"] = [-2.0, -2.0, -2.0]
    save_checkpoint(run, 2, {"w": torch.randn(2)}, {"world_size": 1, "model": sections["model"], "nsa": old_nsa})
    with pytest.raises(CheckpointError, match=r"\(nsa\.gate_bias\)") as err:
        Trainer(r, reporter=quiet())
    assert err.value.hint is not None and "--set nsa.gate_bias=[-2.0,-2.0,-2.0]" in err.value.hint
    Trainer(resolve(run, 4, train__resume="auto", nsa__gate_bias=[-2.0, -2.0, -2.0]), reporter=quiet())
    Trainer(resolve(run, 4, train__resume="auto", nsa__gate_init="slow"), reporter=quiet())


def test_init_from_starts_from_the_weights(full_run: Path, tmp_path: Path) -> None:
    """``train.init_from``: step 0 and a fresh optimizer, the weights of the given run (an lr of ~0 keeps
    them); a model that does not fit, or a path that does not exist, is one line with exit code 2."""
    from safetensors.torch import load_file

    out = tmp_path / "b"
    r = resolve(out, 1, checkpoint__every=0, train__init_from=str(full_run), optimizer__lr=1e-12, train__seq_len=64)
    result = Trainer(r, reporter=quiet()).fit()
    assert result.status == "completed" and result.steps_done == 1
    a, b = load_file(full_run / "export" / "model.safetensors"), load_file(out / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    from nsa_cli.app import app

    res = CliRunner().invoke(app, ["train", "--config", "tiny", "--steps", "1", "--out-dir", str(tmp_path / "c"),
                                   "--set", f"train.init_from={full_run}", "--set", "model.n_layers=1"])
    assert res.exit_code == 2 and "train.init_from:" in res.output and "do not fit" in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "c").exists()
    res = CliRunner().invoke(app, ["train", "--config", "tiny", "--steps", "1", "--out-dir", str(tmp_path / "d"),
                                   "--set", f"train.init_from={tmp_path / 'nothere'}"])
    assert res.exit_code == 2 and "does not exist" in res.output, res.output


def test_init_from_an_export_with_tied_embeddings(tmp_path: Path) -> None:
    """An export stores a tied embedding/head once; ``train.init_from`` still fills both names."""
    from safetensors.torch import load_file

    src, dst = tmp_path / "a", tmp_path / "b"
    Trainer(resolve(src, 2, checkpoint__every=0, model__tie_embeddings=True), reporter=quiet()).fit()
    r = resolve(dst, 1, checkpoint__every=0, train__init_from=str(src), optimizer__lr=1e-12, model__tie_embeddings=True)
    assert Trainer(r, reporter=quiet()).fit().status == "completed"
    a, b = load_file(src / "export" / "model.safetensors"), load_file(dst / "export" / "model.safetensors")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_stop_at_then_resume_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """train.stop_at ends with a checkpoint and the schedule of train.steps; resuming goes on exactly (seed 0)."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    Trainer(resolve(whole, 6, train__seed=0, checkpoint__every=0, logging__every=1), reporter=quiet()).fit()
    first = Trainer(resolve(split, 6, train__seed=0, train__stop_at=4, checkpoint__every=0, logging__every=1),
                    reporter=quiet()).fit()
    assert first.status == "halted" and first.halted_by == "stop_at" and first.steps_done == 4
    assert [e for e in events(split) if e["event"] == "halt"][-1]["source"] == "stop_at"
    assert not (split / "export").exists()  # exported when the run completes, not at a pause
    done = Trainer(resolve(split, 6, train__seed=0, train__resume="auto", checkpoint__every=0, logging__every=1),
                   reporter=quiet()).fit()
    assert done.status == "completed" and done.steps_done == 6
    rows = {p: [(r["step"], r["loss"], r["lr"]) for r in csv_rows(p / "training.csv")] for p in (whole, split)}
    assert rows[split] == rows[whole]  # same losses and the one learning-rate schedule
    # a stop on a periodic step is saved once, as the stop
    every = tmp_path / "every"
    Trainer(resolve(every, 6, train__stop_at=4, checkpoint__every=2), reporter=quiet()).fit()
    saves = [(e["step"], e["reason"]) for e in events(every) if e["event"] == "checkpoint"]
    assert saves == [(2, "periodic"), (4, "stop_at")]
    with pytest.raises(ConfigError, match=r"train\.stop_at=7 is beyond train\.steps=6"):
        Trainer(resolve(tmp_path / "bad", 6, train__stop_at=7), reporter=quiet())
    with pytest.raises(ConfigError, match="not after the step of checkpoint"):
        Trainer(resolve(split, 8, train__stop_at=5, train__resume="auto"), reporter=quiet())


def test_resume_at_a_longer_window_continues_at_the_same_token(tmp_path: Path) -> None:
    """A length curriculum in one run: 4 steps of 2 x 32 tokens, then 2 x 64 from the very next token (seed 0)."""
    run = tmp_path / "run"
    Trainer(resolve(run, 6, train__seed=0, train__stop_at=4, checkpoint__every=0), reporter=quiet()).fit()
    at_stop = load_state(latest_checkpoint(run))["loader"][0]
    out = quiet()
    done = Trainer(resolve(run, 6, train__seed=0, train__seq_len=64, train__resume="auto", checkpoint__every=0),
                   reporter=out).fit()
    assert done.status == "completed" and "windows of 64 tokens from here" in out.text()
    end = load_state(latest_checkpoint(run))
    assert end["train_state"]["tokens_seen"] == 4 * 2 * 32 + 2 * 2 * 64
    loader = end["loader"][0]
    assert loader["seq_len"] == 64 and loader["tokens_seen"] - at_stop["tokens_seen"] == 2 * 2 * 64
    # a synthetic task's episodes are laid out for one length: refused in one line
    syn = tmp_path / "syn"
    Trainer(resolve(syn, 4, train__stop_at=2, data__source="synthetic", checkpoint__every=0, eval__every=0),
            reporter=quiet()).fit()
    with pytest.raises(Exception, match="synthetic episodes are laid out for one length"):
        Trainer(resolve(syn, 4, train__seq_len=64, data__source="synthetic", train__resume="auto",
                        eval__every=0), reporter=quiet()).fit()
