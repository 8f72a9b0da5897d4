"""The trainer's components on their own: checkpointable state (one save/load path), events and their
renderers, the clock."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from nsa.errors import CheckpointError
from nsa.train.distributed import DistInfo
from nsa.train.events import Event, Output, PlainReporter
from nsa.train.metrics import Clock
from nsa.train.schedule import build_scheduler, schedule_lrs
from nsa.train.state import Checkpointable, OptimizerLR, PerRank, RandomStreams, TrainState
from nsa_cli.render.train import RichReporter


def _one_rank() -> DistInfo:
    return DistInfo()


class _Position:
    def __init__(self) -> None:
        self.at = 0

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


def _parts(steps: int = 10) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, TrainState, _Position, Checkpointable]:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_scheduler(opt, steps, 2, 0.1)
    counters, pos = TrainState(), _Position()
    state = Checkpointable(model=model, optimizer=opt, scheduler=OptimizerLR(opt, sched), train_state=counters,
                           loader=PerRank(pos, _one_rank()), rng=PerRank(RandomStreams(), _one_rank()))
    return model, opt, sched, counters, pos, state


def test_checkpointable_round_trip_restores_every_component_and_the_random_streams() -> None:
    """Seeded by the test id: train a few steps, save, disturb everything, load: the same numbers follow."""
    model, opt, sched, counters, pos, state = _parts()
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]
        opt.zero_grad()
    counters.step, counters.tokens_seen, pos.at = 3, 96, 7
    saved = state.state_dict()
    assert set(saved) == {"model", "optimizer", "scheduler", "train_state", "loader", "rng"}
    expect = (torch.rand(3), np.random.rand(), random.random())

    model2, opt2, _, counters2, pos2, state2 = _parts()
    torch.rand(5)
    state2.load_state_dict(saved)
    assert (torch.rand(3).tolist(), np.random.rand(), random.random()) == (expect[0].tolist(), *expect[1:])
    assert counters2.step == 3 and counters2.tokens_seen == 96 and pos2.at == 7
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True))
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_resume_with_more_steps_takes_the_new_schedules_rate() -> None:
    _, opt, sched, _, _, state = _parts(steps=10)
    for _ in range(5):
        opt.step()
        sched.step()  # type: ignore[attr-defined]
    saved = state.state_dict()
    _, opt_long, sched_long, _, _, state_long = _parts(steps=100)
    state_long.load_state_dict(saved)
    assert opt_long.param_groups[0]["lr"] == pytest.approx(schedule_lrs(sched_long)[0])  # type: ignore[arg-type]
    assert opt_long.param_groups[0]["lr"] > opt.param_groups[0]["lr"]  # early in a longer cosine


def test_per_rank_state_reshards_or_refuses_another_world_size() -> None:
    with pytest.raises(CheckpointError, match="written by 2 ranks"):
        PerRank(_Position(), _one_rank()).load_state_dict([{"at": 1}, {"at": 2}])
    pos = _Position()
    per = PerRank(pos, _one_rank(), reshard=lambda states, rank, world: min(states, key=lambda s: s["at"]))
    per.load_state_dict([{"at": 5}, {"at": 2}, {"at": 7}])
    assert pos.state_dict() == {"at": 2} and per.saved_by == 3
    from nsa.data.loader import slowest_position
    from nsa.train.state import by_rank_modulo

    states = [{"position": {"epoch": 0, "index": i, "offset": o}} for i, o in ((9, 3), (8, 50), (8, 7))]
    assert slowest_position(states, 0, 1) is states[2]
    assert [by_rank_modulo(["a", "b"], r, 3) for r in range(3)] == ["a", "b", "a"]
    with pytest.raises(CheckpointError, match="lacks rng"):
        _parts()[-1].load_state_dict({k: {} for k in ("model", "optimizer", "scheduler", "train_state", "loader")})


def test_output_sends_events_on_rank_0_and_writes_every_line_to_the_log(tmp_path: Path) -> None:
    seen: list[Event] = []
    out = Output(seen.append, total=5)
    out.attach_log(tmp_path / "train.log")
    out.start(0)
    out.message("nsa.fixed_gates=[1, 0, 0]", tone="headline")
    out.warn("disk almost full")
    row = {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1500.0, "step_time_s": 0.1, "eta_s": 4}
    out.step(1, row)
    out.log(row)
    out.stop()
    out.close()
    assert [e.kind for e in seen] == ["start", "message", "warning", "step", "log", "stop"]
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert [ln[20:] for ln in lines[:2]] == ["nsa.fixed_gates=[1, 0, 0]", "WARNING disk almost full"]
    assert "step      1/5 | loss 2.5000" in lines[2] and "1.5k tok/s" in lines[2] and lines[2][:4].isdigit()
    quiet: list[Event] = []
    other = Output(quiet.append, total=5, enabled=False)  # another rank: its log file only
    other.message("x")
    assert quiet == []


def test_renderers_print_texts_verbatim() -> None:
    """Brackets in a text are not markup: the Rich view prints config values as they are."""
    plain = PlainReporter(io.StringIO())
    console = Console(file=io.StringIO(), width=200, color_system=None)
    rich_view = RichReporter(console)
    for view in (plain, rich_view):
        view(Event("message", text="gate_bias=[bold][-2.0][/]", tone="good"))
        view(Event("warning", text="[red]x[/red]"))
    assert plain.text().splitlines() == ["gate_bias=[bold][-2.0][/]", "WARNING [red]x[/red]"]
    assert console.file.getvalue().splitlines() == plain.text().splitlines()  # type: ignore[attr-defined]


def test_clock_windows_and_first_step() -> None:
    clock = Clock()
    assert clock.step_done(2.0, 0.1, 64) is True  # the first step (compilation) is not in tokens/s
    assert clock.step_done(1.0, 0.2, 64) is False
    assert clock.take_window() == (2, 3.0, pytest.approx(0.3))
    assert clock.take_window() == (0, 0.0, 0.0)
    assert clock.tokens_after_first == 64 and clock.train_s == 3.0


def test_optimizer_state_by_name_and_back_and_the_whole_view() -> None:
    """``by_name`` keys a ``torch.optim`` state dict by parameter names (the DCP form) and ``by_number``
    undoes it exactly; the whole view of a model and optimizer gives the unsharded checkpoint's entries."""
    from nsa.config import load_run_config
    from nsa.model import build_model
    from nsa.train.parallel import WholeIntoShards, by_name, by_number
    from nsa.train.step import build_optimizer

    torch.manual_seed(7)
    cfg = load_run_config("tiny", environ={}, flags={}).config
    model = build_model(cfg)
    opt = build_optimizer(model, cfg, "cpu")
    model(torch.randint(0, 256, (1, 16))).logits.sum().backward()
    opt.step()
    saved = opt.state_dict()
    named = by_name(model, opt, saved)
    assert set(named["state"]) <= {n for n, _ in model.named_parameters()}
    back = by_number(model, opt, named)
    assert back["param_groups"] == saved["param_groups"] and back["state"].keys() == saved["state"].keys()
    assert all(torch.equal(back["state"][i]["exp_avg"], saved["state"][i]["exp_avg"]) for i in saved["state"])
    whole = WholeIntoShards(model, opt).state_dict()
    assert all(torch.equal(whole["state"][i]["exp_avg_sq"], saved["state"][i]["exp_avg_sq"]) for i in saved["state"])
    assert all(torch.equal(WholeIntoShards(model).state_dict()[k], v) for k, v in model.state_dict().items())
