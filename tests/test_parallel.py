"""Data parallelism on CPU (gloo, two ranks through ``nsa train --nproc-per-node 2``): FSDP2 gives the
losses of DDP, its sharded checkpoints (``torch.distributed.checkpoint``, one file per rank, covered by
the manifest's checksums) resume exactly, the export is one whole model, and a checkpoint moves
exactly between numbers of ranks and between shards and whole tensors; two launchers as two nodes meeting at a static
rendezvous (node 0 hosts the store) train like two ranks of one node, and stop alike on a mistake."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nsa.config import load_run_config
from nsa.rundir.checkpoints import verify
from tests.conftest import Job, free_port, run_job
from tests.test_train_process import _env, cmd, run_all_ok, run_ok

# S=64 (beyond the window of 32): the evaluations at steps 3 and 6 have selection diagnostics to record
SEQ = ["--set", "train.seq_len=64"]
COMMON = ["--steps", "6", "--nproc-per-node", "2", *SEQ, "--set", "eval.every=3", "--set", "eval.batches=1",
          "--set", "checkpoint.every=3"]


def _rows(run: Path) -> list[dict[str, str]]:
    return _rows_of(run / "training.csv")


def _rows_of(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


RUNS = ("ddp", "fsdp", "resumed", "fsdp-compiled", "fsdp-per-block")


def _train_runs() -> None:
    """The runs the slow tests read, made by a job beside the tests (it starts with the session): DDP and FSDP
    side by side (the tiny model one FSDP unit: ``runtime.fsdp_unit_blocks`` auto), then FSDP resumed from its
    step-3 checkpoint beside FSDP with a unit per block (``runtime.fsdp_unit_blocks=1``), then FSDP compiled
    (each block before sharding: ``runtime.compile_scope`` auto). Prints the folder that holds them."""
    root = Path(tempfile.mkdtemp(prefix="nsa-test-parallel-"))
    out = {name: root / name for name in RUNS}
    try:
        run_all_ok(cmd(*COMMON, "--out-dir", str(out["ddp"])),
                   cmd(*COMMON, "--out-dir", str(out["fsdp"]), "--set", "runtime.parallel=fsdp"))
        ckpt = out["fsdp"] / "checkpoints" / "step_00000003"
        run_all_ok(cmd(*COMMON, "--out-dir", str(out["resumed"]), "--set", "runtime.parallel=fsdp", "--resume", str(ckpt)),
                   cmd(*COMMON, "--out-dir", str(out["fsdp-per-block"]), "--set", "runtime.parallel=fsdp",
                       "--set", "runtime.fsdp_unit_blocks=1"))
        run_ok(cmd(*COMMON, "--out-dir", str(out["fsdp-compiled"]), "--set", "runtime.parallel=fsdp", "--compile"))
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    print(root)


RUNS_JOB = Job("from tests.test_parallel import _train_runs\n_train_runs()\n", interpret=False, timeout=900)


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Path]]:
    root = Path(run_job(RUNS_JOB).stdout.strip().splitlines()[-1])
    try:
        yield {name: root / name for name in RUNS}
    finally:
        shutil.rmtree(root, ignore_errors=True)


# the tests that read the runs: their job starts with the session, they keep their place
beside_runs = pytest.mark.beside(RUNS_JOB, keep_place=True)


@pytest.mark.slow
@beside_runs
def test_fsdp_compiled_block_by_block_trains_like_eager(runs: dict[str, Path]) -> None:
    """FSDP2 with each block compiled before ``fully_shard`` (CPU Inductor, gloo) gives the eager FSDP run's losses."""
    eager, compiled = _rows(runs["fsdp"]), _rows(runs["fsdp-compiled"])
    assert [r["step"] for r in compiled] == [r["step"] for r in eager] == ["1", "2", "3", "4", "5", "6"]
    for a, b in zip(eager, compiled, strict=True):
        assert abs(float(a["loss"]) - float(b["loss"])) <= 1e-3 * abs(float(a["loss"])), (a, b)


@pytest.mark.slow
@beside_runs
def test_fsdp_trains_like_ddp(runs: dict[str, Path]) -> None:
    ddp, fsdp = _rows(runs["ddp"]), _rows(runs["fsdp"])
    assert [r["step"] for r in fsdp] == ["1", "2", "3", "4", "5", "6"]
    for a, b in zip(ddp, fsdp, strict=True):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-5), (a, b)
        assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=1e-4), (a, b)


@pytest.mark.slow
@beside_runs
def test_fsdp_units_do_not_change_the_arithmetic(runs: dict[str, Path]) -> None:
    """The whole model as one FSDP2 unit (one gather, one reduce-scatter a step) gives the per-block units' losses
    and gradient norms."""
    whole, blocks = _rows(runs["fsdp"]), _rows(runs["fsdp-per-block"])
    assert [r["step"] for r in whole] == [r["step"] for r in blocks]
    for a, b in zip(blocks, whole, strict=True):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-5), (a, b)
        assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=1e-4), (a, b)


@pytest.mark.slow
@beside_runs
def test_sharded_checkpoint_is_complete_and_resumes_exactly(runs: dict[str, Path]) -> None:
    ckpt = runs["fsdp"] / "checkpoints" / "step_00000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["sharded"] is True and manifest["world_size"] == 2
    assert {"state.pt", "sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(manifest["files"])
    assert verify(ckpt).ok
    resumed = {r["step"]: r for r in _rows(runs["resumed"])}
    for r in _rows(runs["fsdp"])[3:]:  # steps 4..6, to the last printed digit
        assert (resumed[r["step"]]["loss"], resumed[r["step"]]["grad_norm"]) == (r["loss"], r["grad_norm"])


@pytest.mark.slow
@beside_runs
def test_fsdp_export_is_one_whole_model(runs: dict[str, Path]) -> None:
    from nsa.model.load import load_model

    loaded = load_model(runs["fsdp"], device="cpu")
    ref = load_model(runs["ddp"], device="cpu")
    for (name, a), (_, b) in zip(loaded.model.state_dict().items(), ref.model.state_dict().items(), strict=True):
        assert a.shape == b.shape and not hasattr(a, "full_tensor"), name
        assert (a - b).abs().max() < 1e-4, name


def _shards(ckpt: Path, tmp: Path) -> dict:
    """A sharded checkpoint's model and optimizer as whole tensors (``dcp_to_torch_save``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(ckpt / "sharded", out)
    return torch.load(out, weights_only=False)["sharded"]


def _same_optimizer(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for name, st in a["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][name][key])), (name, key)
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]


@pytest.mark.slow
@beside_runs
def test_a_checkpoint_moves_between_numbers_of_ranks_exactly(runs: dict[str, Path], tmp_path: Path) -> None:
    """Saved by 2 FSDP ranks, resumed by 1 process (whole model), resumed back by 2 FSDP ranks, with no
    step in between: the model and every optimizer moment are bitwise those of the first checkpoint at each
    hop, and the run says what it did with the data position. (The one-process hop runs in this process.)"""
    from nsa.model import build_model
    from nsa.train.parallel import by_name
    from nsa.train.step import build_optimizer
    from nsa.train.trainer import Trainer
    from tests.conftest import quiet, resolve

    src = runs["fsdp"] / "checkpoints" / "step_00000003"
    one, back = tmp_path / "one", tmp_path / "back"
    said = quiet()
    hop = resolve(one, 3, train__seq_len=64, eval__every=0, train__resume=str(src))
    assert Trainer(hop, reporter=said).fit().status == "completed"
    assert "resumed a checkpoint of 2 data rank(s) on 1" in said.text()
    whole = torch.load(one / "checkpoints" / "step_00000003" / "state.pt", weights_only=True)
    ref = _shards(src, tmp_path)
    assert whole["model"].keys() == ref["model"].keys()
    assert all(torch.equal(whole["model"][k], ref["model"][k]) for k in ref["model"])
    cfg = load_run_config("tiny", environ={}, flags={}).config
    model = build_model(cfg)
    _same_optimizer(by_name(model, build_optimizer(model, cfg, "cpu"), whole["optimizer"]), ref["optimizer"])

    run_ok(cmd("--steps", "3", "--nproc-per-node", "2", *SEQ, "--set", "runtime.parallel=fsdp", "--set", "eval.every=0",
               "--out-dir", str(back), "--resume", str(one / "checkpoints" / "step_00000003")))
    again = _shards(back / "checkpoints" / "step_00000003", tmp_path)
    assert all(torch.equal(again["model"][k], ref["model"][k]) for k in ref["model"])
    _same_optimizer(again["optimizer"], ref["optimizer"])


@pytest.mark.slow
@beside_runs
def test_two_nodes_through_the_rendezvous_train_like_one(runs: dict[str, Path], tmp_path: Path) -> None:
    """Two launchers as two nodes on localhost (``--nnodes 2 --node-rank i --rdzv-endpoint``), one rank each,
    give the losses of two ranks on one node; each rank writes its own heartbeat."""
    run = tmp_path / "two-nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    base = [a for a in COMMON if a != "--nproc-per-node" and a != "2"]
    nodes = [subprocess.Popen(cmd(*base, "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(i),
                                  "--rdzv-endpoint", endpoint, "--rdzv-id", "test", "--out-dir", str(run)),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "--rdzv-backend=static" in outs[0] and "--nnodes=2" in outs[1]
    assert (run / "heartbeat_rank0.jsonl").exists() and (run / "heartbeat_rank1.jsonl").exists()
    for a, b in zip(_rows(runs["ddp"]), _rows(run), strict=True):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-6), (a, b)


def test_multi_node_flags_are_checked_before_any_work(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from nsa_cli.app import app

    base = ["train", "--config", "tiny", "--steps", "2", "--out-dir", str(tmp_path / "r")]
    for extra, needle in ((["--nproc-per-node", "1", "--nnodes", "2"], "--rdzv-endpoint"),
                          (["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
                           "--node-rank 2"),
                          (["--nnodes", "2", "--rdzv-endpoint", "h:1"], "--nproc-per-node"),
                          (["--nproc-per-node", "1", "--rdzv-endpoint", "nohost"], "HOST:PORT")):
        res = CliRunner().invoke(app, base + extra)
        assert res.exit_code == 2 and needle in res.output, (extra, res.output)
        assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_user_error_in_the_ranks_is_one_line_through_the_launcher(tmp_path: Path) -> None:
    """A mistake only the ranks can see (an unreachable dataset, offline) ends a torchrun launch with the
    ranks' one-line error and exit 2, without torchrun's traceback."""
    res = subprocess.run(cmd("--steps", "2", "--nproc-per-node", "2", "--dataset", "fineweb_edu",
                             "--set", "data.timeout_s=5", "--out-dir", str(tmp_path / "r")),
                         env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 2, res.stderr[-3000:]
    # offline: "unreachable", or "no data within data.timeout_s" when the hub client's retries outlast it
    assert "error: data source" in res.stderr
    assert "unreachable" in res.stderr or "no data within data.timeout_s=5s" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "ChildFailedError" not in res.stderr
    assert "a rank exited with code 2" in res.stderr


RANK_REFUSED = """
import atexit, sys
atexit.register(lambda: print("teardown ran", file=sys.stderr))
sys.argv = ["nsa", "train", "--config", "no-such-config", "--steps", "1"]
from nsa_cli.app import main
main()
"""


def test_a_rank_that_refuses_its_input_exits_2_without_the_interpreters_teardown() -> None:
    """A torchrun rank (``WORLD_SIZE`` > 1) that says a user error in one line exits 2 at once, before the
    interpreter's teardown (where the distributed runtime's threads could abort it: exit -6); alone, the same
    error exits 2 through the ordinary teardown."""
    for world, teardown in (("2", False), ("1", True)):
        res = subprocess.run([sys.executable, "-c", RANK_REFUSED], env={**_env(), "WORLD_SIZE": world},
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, res.stderr[-2000:]
        assert res.stderr.count("error:") == 1 and "no-such-config" in res.stderr, res.stderr[-2000:]
        assert ("teardown ran" in res.stderr) is teardown, (world, res.stderr[-2000:])


@pytest.mark.slow
def test_nodes_that_resolve_different_configs_are_refused(tmp_path: Path) -> None:
    """Two nodes started with different flags stop before any work with one line naming the key, and both
    launchers exit 2. (Issue 26: on the dynamic c10d rendezvous, the node hosting the store could exit first,
    and the other node's torchrun, still watching its rank, lost the store: RendezvousConnectionError, exit 1;
    and the port, picked by bind(0) and released, could be taken before the store bound it.)"""
    run, endpoint = tmp_path / "r", f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen(cmd("--steps", "2", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(i),
                                  "--rdzv-endpoint", endpoint, "--out-dir", str(run), "--lr", lr),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i, lr in ((0, "0.003"), (1, "0.001"))]
    outs = [p.communicate(timeout=240)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [2, 2], outs
    assert all("resolved another config than rank 0: optimizer.lr" in o and "Traceback" not in o for o in outs), outs
    assert not (run / "checkpoints").exists()


LINGERING_RANK = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
seen = [None] * dist.get_world_size()
dist.all_gather_object(seen, dist.get_rank())
time.sleep(float(os.environ.get("LINGER_S", "0")))  # this node's rank takes longer to stop
dist.destroy_process_group()
print(f"error: rank {dist.get_rank() if dist.is_initialized() else '?'} stops (a user error)", file=sys.stderr)
sys.exit(2)
"""

LAUNCHER = """
import sys
from nsa.train.launch import Rendezvous, launch, torchrun_argv
sys.exit(launch(torchrun_argv(1, [sys.argv[1]], Rendezvous(2, int(sys.argv[2]), sys.argv[3]))))
"""


@pytest.mark.slow
def test_both_nodes_report_their_ranks_code_when_the_store_host_stops_first(tmp_path: Path) -> None:
    """Node 0 starts first (so it hosts the rendezvous store), its rank stops at once; node 1's rank lingers
    3 s before it stops too. Node 0's launcher ends first: node 1's torchrun must still report its rank's exit
    code (2), not lose the store while watching the rank (the dynamic c10d rendezvous: exit 1, traceback)."""
    import time

    script = tmp_path / "rank.py"
    script.write_text(LINGERING_RANK)
    endpoint = f"127.0.0.1:{free_port()}"
    env = _env()
    first = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(script), "0", endpoint], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(3)  # node 0's agent is up and hosts the store before node 1 starts
    second = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(script), "1", endpoint],
                              env={**env, "LINGER_S": "3"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = [p.communicate(timeout=240)[0] for p in (first, second)]
    assert [first.returncode, second.returncode] == [2, 2], outs
    assert all("stops (a user error)" in o and "RendezvousConnectionError" not in o for o in outs), outs


@pytest.mark.slow
@beside_runs
def test_fsdp_runs_record_the_selection_diagnostics(runs: dict[str, Path]) -> None:
    """The selection report runs through the sharded root's forward (its hooks gather the shards): the FSDP run
    evaluates at steps 3 and 6, its resumed run at step 6, each with the selection figures."""
    for name, steps in (("fsdp", ["3", "6"]), ("resumed", ["6"])):
        rows = _rows_of(runs[name] / "val.csv")
        assert [r["step"] for r in rows] == steps, (name, rows)
        assert all(0 < float(r["sel_recall_mean"]) <= 1 and 0 < float(r["cmp_entropy_mean"]) <= 1 + 1e-5
                   for r in rows), (name, rows)



LATE_REPORT = """
import subprocess, sys
# a grandchild that still holds standard error prints torchrun's failure line 11 s after torchrun (this
# process) has exited 1: past the 10 s the launcher gives the relay when the run succeeded
subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(11); "
                  "sys.stderr.write('torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 2)\\\\n')"])
sys.exit(1)
"""


def test_the_ranks_code_is_returned_when_its_line_comes_late(tmp_path: Path) -> None:
    """torchrun exits 1 and its report of the rank's exit code (2: a user error) reaches the launcher's relay
    only later (a loaded machine): the launcher still returns 2."""
    from nsa.train.launch import launch

    assert launch([sys.executable, "-c", LATE_REPORT], notice=lambda line: None) == 2
