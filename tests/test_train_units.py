"""Trainer parts on their own: schedule, atomic checkpoints, run-directory helpers, telemetry."""

from __future__ import annotations

import csv
import importlib
import itertools
import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from nsa.errors import CheckpointError
from nsa.rundir import RunDir
from nsa.train import checkpoint as ckpt
from nsa.train.rundir import archive_stale_halt, halt_request
from nsa.train.schedule import build_scheduler, lr_multiplier, schedule_lrs
from nsa.train.signals import SignalFlags
from nsa.train.telemetry import CsvLog, Heartbeat, peak_flops, recorded_environment, redact_env


def test_schedule_warmup_then_cosine_in_optimizer_steps() -> None:
    total, warm, floor = 100, 10, 0.1
    mult = [lr_multiplier(s, total, warm, floor) for s in range(total)]
    assert mult[0] == pytest.approx(0.1) and mult[9] == pytest.approx(1.0)
    assert all(a < b for a, b in itertools.pairwise(mult[:10]))
    assert all(a >= b for a, b in itertools.pairwise(mult[10:]))
    assert lr_multiplier(total, total, warm, floor) == pytest.approx(floor)
    # warmup longer than the run is clamped to the run
    assert lr_multiplier(4, 5, 50, floor) == pytest.approx(1.0)


def test_schedule_lrs_is_the_rate_of_the_next_update() -> None:
    """``schedule_lrs`` (what a resume writes into the optimizer) equals the rate the scheduler sets, at
    every step of warmup and decay, for two parameter groups with different base rates."""
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    opt = torch.optim.SGD([{"params": [a], "lr": 0.5}, {"params": [b], "lr": 0.1}])
    sched = build_scheduler(opt, 20, 4, 0.1)
    for _ in range(22):
        assert schedule_lrs(sched) == pytest.approx([g["lr"] for g in opt.param_groups], rel=1e-12)
        opt.step()
        sched.step()


def _state() -> dict:
    return {"w": torch.randn(4, 3), "step": random.randint(1, 99), "nested": {"a": [1, 2.5, "x"]}}


def test_checkpoint_atomic_listing_and_prune(tmp_path: Path) -> None:
    saved = {s: _state() for s in (2, 4, 6)}
    for s, st in saved.items():
        ckpt.save_checkpoint(tmp_path, s, st, {"world_size": 1})
    root = tmp_path / "checkpoints"
    # debris a kill could leave: a temp folder, a folder without manifest, a truncated state.pt
    (root / ".tmp-step_00000008-1-1").mkdir()
    (root / ".tmp-step_00000008-1-1" / "state.pt").write_bytes(b"partial")
    (root / "step_00000009").mkdir()
    (root / "step_00000009" / "state.pt").write_bytes(b"no manifest")
    bad = root / "step_00000010"
    bad.mkdir()
    (bad / "state.pt").write_bytes(b"short")
    (bad / "manifest.json").write_text(json.dumps({"files": {"state.pt": 999}}))
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004", "step_00000006"]
    assert ckpt.resolve_resume(tmp_path, "auto") == root / "step_00000006"
    loaded = ckpt.load_state(root / "step_00000004")
    assert torch.equal(loaded["w"], saved[4]["w"]) and loaded["nested"] == saved[4]["nested"]
    assert ckpt.prune(tmp_path, 2) == [root / "step_00000002"]
    assert ckpt.clean_partials(tmp_path) and not list(root.glob(".tmp-*"))
    with pytest.raises(CheckpointError, match="not a usable checkpoint"):
        ckpt.resolve_resume(tmp_path, str(bad))
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        ckpt.resolve_resume(tmp_path, str(tmp_path / "nope"))
    assert ckpt.resolve_resume(tmp_path, str(root / "step_00000004" / "state.pt")) == root / "step_00000004"
    assert ckpt.resolve_resume(tmp_path, str(tmp_path)) == root / "step_00000006"
    assert ckpt.resolve_resume(tmp_path / "empty", "auto") is None


def test_checkpoint_save_replaces_incomplete_folder_of_same_step(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "step_00000003").mkdir(parents=True)
    (root / "step_00000003" / "state.pt").write_bytes(b"junk")
    st = _state()
    path = ckpt.save_checkpoint(tmp_path, 3, st)
    assert ckpt.is_complete(path) and torch.equal(ckpt.load_state(path)["w"], st["w"])


def test_halt_file_reading_and_archive(tmp_path: Path) -> None:
    assert halt_request(tmp_path) is None
    (tmp_path / ".HALT").write_text(json.dumps({"reason": "loss spike", "who": "watch"}))
    assert halt_request(tmp_path)[0] == "loss spike"
    (tmp_path / ".HALT").write_text("  maintenance window \n")
    assert halt_request(tmp_path)[0] == "maintenance window"
    (tmp_path / ".HALT").write_text("")
    assert halt_request(tmp_path, settle_s=0.05)[0] == "halt file"


def test_halt_file_caught_mid_write_is_reread(tmp_path: Path) -> None:
    """``echo reason > .HALT`` truncates first: an empty or cut-short file is re-read until it settles."""
    import threading

    for partial in ("", '{"reason": "disk fu'):
        (tmp_path / ".HALT").write_text(partial)
        writer = threading.Timer(0.05, lambda: (tmp_path / ".HALT").write_text('{"reason": "disk full"}'))
        writer.start()
        assert halt_request(tmp_path, settle_s=5.0)[0] == "disk full"
        writer.join()


def test_halt_archive(tmp_path: Path) -> None:
    (tmp_path / ".HALT").write_text("stop")
    dest = archive_stale_halt(RunDir(tmp_path))
    assert dest is not None and dest.parent.name == "halts" and not (tmp_path / ".HALT").exists()
    assert archive_stale_halt(RunDir(tmp_path)) is None


def test_redaction_of_secrets() -> None:
    env = {"HF_TOKEN": "hf_abc", "WANDB_API_KEY": "k", "MY_SECRET": "s", "DB_PASSWORD": "p",
           "CUDA_VISIBLE_DEVICES": "0,1", "HF_HOME": "/data/hf", "UNRELATED": "x"}
    red = redact_env(env)
    assert red["HF_TOKEN"] == red["WANDB_API_KEY"] == red["MY_SECRET"] == red["DB_PASSWORD"] == "<redacted>"
    assert red["CUDA_VISIBLE_DEVICES"] == "0,1"
    rec = recorded_environment(env)
    assert rec == {"CUDA_VISIBLE_DEVICES": "0,1", "HF_HOME": "/data/hf", "HF_TOKEN": "<redacted>"}


def test_csv_resume_truncates_later_rows(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    log = CsvLog(path, ("step", "loss"))
    for s in range(1, 8):
        log.row({"step": s, "loss": random.random()})
    log.close()
    log = CsvLog(path, ("step", "loss"), keep_until_step=4)
    log.row({"step": 5, "loss": 0.5})
    log.close()
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "loss"] and [r[0] for r in rows[1:]] == ["1", "2", "3", "4", "5"]


def test_heartbeat_rejects_fields_outside_the_schema(tmp_path: Path) -> None:
    hb = Heartbeat(RunDir(tmp_path).heartbeat(3), 3)
    rec = hb.emit("end", 7, status="completed", error=None)
    with pytest.raises(ValueError, match="schema"):
        hb.emit("end", 7, status="completed")
    hb.close()
    line = json.loads((tmp_path / "heartbeat_rank3.jsonl").read_text().splitlines()[0])
    assert line == rec and line["rank"] == 3 and line["pid"] == os.getpid() and line["schema"] == 1


def test_peak_flops_table() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", None)[0] == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", None)[0] == 312e12
    assert peak_flops("NVIDIA H100 PCIe", None)[0] == 756e12
    assert peak_flops("cpu", None)[0] is None
    assert peak_flops("cpu", 2.0) == (2e12, "logging.mfu_peak_tflops")


def test_signal_flags_set_by_handlers() -> None:
    flags = SignalFlags()
    flags.install(None)
    try:
        signal.raise_signal(signal.SIGUSR2)
        assert flags.save_now
        signal.raise_signal(signal.SIGTERM)
        assert flags.halt_source == "SIGTERM"
        signal.raise_signal(signal.SIGTERM)  # repeated SIGTERM: still the graceful halt
        assert flags.halt_source == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # a second request stops at once
    finally:
        flags.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not flags._on_halt


def test_the_same_signal_again_within_the_window_is_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 57: a signal to a process group reaches the trainer twice under ``uv run`` (its copy 200 ms later
    for SIGINT). A copy is no second request; the same signal after the window is; the handlers absorb a late
    copy while they wait out the window at uninstall."""
    import time

    import nsa.train.signals as signals

    monkeypatch.setattr(signals, "SAME_REQUEST_S", 0.3)
    flags = SignalFlags()
    flags.install(None)
    try:
        signal.raise_signal(signal.SIGINT)
        assert flags.halt_source == "SIGINT"
        signal.raise_signal(signal.SIGINT)  # uv's copy: no KeyboardInterrupt
        assert flags.said[-1].startswith("SIGINT again within 0.3 s: the same request")
        time.sleep(0.35)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # the operator's second Ctrl-C
        t0 = time.monotonic()
    finally:
        flags.uninstall()
    assert time.monotonic() - t0 >= 0.25  # the window after the last signal, waited out before restoring
    assert signals.is_copy(2, (2, 10.0), 10.2) and not signals.is_copy(15, (2, 10.0), 10.2)
    assert not signals.is_copy(2, (2, 10.0), 10.4) and not signals.is_copy(2, None, 10.0)


def test_cuda_random_state_is_this_ranks_device_and_restores_on_fewer_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32: a 2-GPU run resumed on one GPU crashed in ``torch.cuda.set_rng_state_all`` (every rank saved
    one state per visible GPU). Now a rank saves its own device's state and restores it to its own device;
    older checkpoints (a list per visible GPU) restore the entry of this device, or the first one."""
    from nsa.train import runtime

    states = {0: torch.tensor([1], dtype=torch.uint8), 1: torch.tensor([2], dtype=torch.uint8)}
    restored: list[tuple[int, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: states[device])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: restored.append((int(s[0]), device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("one device's state, not all"))
    saved = runtime.rng_state()
    assert torch.equal(saved["cuda_device"], states[1]) and "cuda" not in saved
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # resumed where only one GPU is visible
    runtime.set_rng_state(saved)
    legacy = {**saved, "cuda": [states[0], states[1]]}
    del legacy["cuda_device"]
    runtime.set_rng_state(legacy)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    runtime.set_rng_state(legacy)  # a device the saver did not see: its first state
    assert restored == [(2, 0), (1, 0), (1, 3)]


def test_step_hooks_are_registered_by_the_config_and_split_their_totals() -> None:
    """``nsa.train.hooks``: the scorer's warm-up ends after ``scorer.until``; the answer metrics' sums join
    the step's all-reduce and come back as ``answer_loss``/``answer_acc``."""
    from types import SimpleNamespace

    from nsa.config import load_named
    from nsa.train.hooks import AnswerMetrics, ScorerWarmup, step_hooks

    cfg = load_named("tiny")
    assert step_hooks(cfg, None, None).hooks == []
    calls: list[tuple[int, float]] = []
    model = SimpleNamespace(set_scorer=lambda p: calls.append((p.queries, p.weight)))
    on = cfg.model_copy(update={"scorer": cfg.scorer.model_copy(update={"weight": 0.5, "until": 2})})
    hooks = step_hooks(on, model, torch.tensor([False, True, True]))
    assert [type(h) for h in hooks.hooks] == [ScorerWarmup, AnswerMetrics]
    for step in (1, 2, 3, 4):
        hooks.on_step_start(step)
        assert calls == ([] if step <= 2 else [(0, 0.0)])
    logits = torch.zeros(1, 3, 5)
    logits[0, 1, 2] = 9.0  # right at position 1, wrong at position 2
    hooks.on_micro_batch(SimpleNamespace(logits=logits), torch.tensor([[0, 2, 3]]))
    sums = hooks.step_sums()
    assert len(sums) == 3 and float(sums[1]) == 1.0 and float(sums[2]) == 2.0
    fields = hooks.log_fields([float(v) * 2 for v in sums])  # two ranks with the same answers
    assert list(fields) == ["answer_loss", "answer_acc"] and fields["answer_acc"] == 0.5
    assert fields["answer_loss"] == pytest.approx(float(sums[0]) / 2)


def test_shard_clipping_matches_clip_grad_norm() -> None:
    """FSDP2's clipping on the gradient shards (``parallel.sum_of_squares``, ``clip_shards``) scales as
    ``clip_grad_norm_`` does over whole gradients: shards split like two ranks', squares summed (seed 4)."""
    from nsa.train import parallel

    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(7, 5, generator=g) * 3, torch.randn(11, generator=g), torch.randn(3, 3, 2, generator=g)]
    whole = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    for p, x in zip(whole, grads, strict=True):
        p.grad = x.clone()
    want = torch.nn.utils.clip_grad_norm_(whole, 1.0)
    ranks = [[x.clone()[: len(x) // 2] for x in grads], [x.clone()[len(x) // 2:] for x in grads]]
    total = sum(parallel.sum_of_squares(r, torch.device("cpu")) for r in ranks).sqrt()
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    for r in ranks:
        parallel.clip_shards(r, total, 1.0)
    for p, a, b in zip(whole, *ranks, strict=True):
        torch.testing.assert_close(torch.cat([a, b]), p.grad, rtol=1e-6, atol=1e-7)
    assert parallel.grad_shards(whole) is None  # plain parameters: clip_grad_norm_ serves them


def test_fsdp_units_group_consecutive_blocks() -> None:
    """``runtime.fsdp_unit_blocks``: k consecutive blocks a unit (a list when k > 1), the last flagged; 0: none."""
    from nsa.train.parallel import units

    blocks = ["b0", "b1", "b2", "b3", "b4"]
    assert units(blocks, 1) == [(False, "b0"), (False, "b1"), (False, "b2"), (False, "b3"), (True, "b4")]
    assert units(blocks, 2) == [(False, ["b0", "b1"]), (False, ["b2", "b3"]), (True, "b4")]
    assert units(blocks, 5) == [(True, blocks)] and units(blocks, 0) == []


@pytest.mark.parametrize("reduce,want", [("fp32", torch.float32), ("low", torch.bfloat16)])
def test_shard_gives_fully_shard_the_reduce_dtype(reduce: str, want: torch.dtype,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``runtime.fsdp_reduce_dtype``: bf16 parameters on CUDA reduce-scatter their gradients in fp32 by default,
    in bf16 with ``low``; every unit and the root get the same policy (``fully_shard`` recorded, not run)."""
    import torch.distributed.fsdp as fsdp

    from nsa.config import load_run_config
    from nsa.train import parallel

    cfg = load_run_config(config="tiny", sets=[f"runtime.fsdp_reduce_dtype={reduce}",
                                               "runtime.fsdp_unit_blocks=1"]).config
    seen: list[object] = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: seen.append(kw["mp_policy"]))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))

        def block_list(self) -> list[torch.nn.Module]:
            return list(self.blocks)

    parallel.shard(Model(), cfg, "bf16", "cuda")
    assert len(seen) == 3  # two blocks, then the root
    assert all(p.param_dtype == torch.bfloat16 and p.reduce_dtype == want for p in seen)  # type: ignore[attr-defined]


def test_shard_adamw_steps_fsdp2_shards_as_adamw_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``parallel.ShardAdamW`` on FSDP2's DTensor parameters (one gloo rank in this process) gives AdamW's
    parameters and moments exactly over three steps (weight decay on one group), and the update it launches sees
    plain tensors (no DTensor dispatch); ``build_optimizer`` picks it for sharded parameters only."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from nsa.config import load_run_config
    from nsa.train import parallel
    from nsa.train.step import build_optimizer

    adam_module = importlib.import_module("torch.optim.adam")  # the module (torch.optim.adam is the class's name)
    seen: list[bool] = []
    real_adam = adam_module.adam

    def spy(params: list[torch.Tensor], *a: object, **kw: object) -> None:
        seen.append(any(isinstance(t, DTensor) for t in params))
        real_adam(params, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(adam_module, "adam", spy)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        sharded = copy.deepcopy(ref)
        fully_shard(sharded)

        def groups(m: torch.nn.Module) -> list[dict[str, object]]:
            ps = list(m.parameters())
            return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]

        opt_ref = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.9, 0.95))
        opt = parallel.ShardAdamW(groups(sharded), lr=1e-2, betas=(0.9, 0.95))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(5, 8, generator=g)
            for m, o in ((ref, opt_ref), (sharded, opt)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad(set_to_none=True)
        for (name, a), b in zip(ref.named_parameters(), sharded.parameters(), strict=True):
            assert isinstance(b, DTensor)
            assert torch.equal(a, b.full_tensor()), name
            st_a, st_b = opt_ref.state[a], opt.state[b]
            assert isinstance(st_b["exp_avg"], DTensor)  # checkpoints (DCP) see the same state as before
            assert torch.equal(st_a["exp_avg_sq"], st_b["exp_avg_sq"].full_tensor()), name
        assert seen == [False] * 12  # 3 steps x 2 groups x 2 optimizers: plain tensors, the shards for ShardAdamW

        cfg = load_run_config("tiny", environ={}).config
        assert type(build_optimizer(sharded, cfg, "cpu")) is parallel.ShardAdamW
        assert type(build_optimizer(ref, cfg, "cpu")) is torch.optim.AdamW
    finally:
        dist.destroy_process_group()


def test_the_launcher_reads_a_clean_halt_of_every_rank(tmp_path: Path) -> None:
    """``nsa.train.launch._halted``: every rank's session booted after the launch ended ``halted`` (then a torchrun
    that exited non-zero after a signal still makes ``nsa train`` exit 0); an earlier session, a rank missing or
    one that failed does not count."""
    import time

    from nsa.train.launch import _halted
    from tests.conftest import write_run

    t0 = time.time() - 100
    run = write_run(tmp_path / "run", steps=10, ranks=2, end="halted", halt_reason="SIGTERM received", ts0=t0 + 1,
                    seed=1)
    assert _halted(run, t0)
    assert not _halted(run, t0 + 50)  # booted before the launch: another session
    hb1 = run / "heartbeat_rank1.jsonl"
    hb1.write_text(hb1.read_text().replace('"status": "halted"', '"status": "failed"'))
    assert not _halted(run, t0)
    hb1.unlink()
    assert not _halted(run, t0)  # world_size 2, one rank's record


def test_a_session_reports_only_its_own_fallbacks() -> None:
    """``metrics.fallback_counts(since)``: counts of the process less those before the session (a second run in
    one process, e.g. ``nsa bench quality``'s arms, does not inherit the first's fallbacks)."""
    from nsa.ops import record_fallback
    from nsa.train.metrics import fallback_counts

    record_fallback("test-earlier-session")
    before = fallback_counts()
    assert fallback_counts(before) == {}
    record_fallback("test-earlier-session")
    record_fallback("test-this-session")
    assert fallback_counts(before) == {"test-earlier-session": 1, "test-this-session": 1}
