"""Two GPUs (NCCL; issue 32), run on a machine with two CUDA devices by ``pytest -m multigpu``, skipped
cleanly elsewhere: context parallelism against one GPU (the model within bf16 tolerance, the trainer's losses),
and checkpoints moving between numbers of GPUs and between DDP and FSDP (exact where the world is unchanged,
a one-line note where it is not). The CPU (gloo) versions of these run in CI: tests/test_context_parallel.py,
tests/test_parallel.py."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nsa.config import ModelConfig, NSAConfig
from nsa.model.context import ContextParallel
from nsa.model.lm import NSALM
from tests.conftest import free_port
from tests.test_context_parallel import reduced
from tests.test_train_process import _env, cmd

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.slow]

# the paper's block sizes (l=32, d=16, l'=64, n=16, w=512) on a small model: S=4096 over two GPUs is four
# chunks of 1024, so every chunk runs the Triton kernels with queries at an offset and a full window
MODEL = ModelConfig(vocab_size=256, dim=256, n_layers=2, n_heads=8, n_kv_groups=2, d_k=64, d_v=64,
                    mlp_hidden=512, max_seq_len=4096)
NSA = NSAConfig()
S = 4096
# packed documents over the [2, 4096] batch: documents across the chunks of 1024, one starting exactly at one,
# one shorter than a compression block
DOCS = torch.tensor([0, 700, 1500, 2500, 2520, 4096, 5120, 5130, 7000, 8192], dtype=torch.int32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _model(attention: str, device: torch.device) -> NSALM:
    torch.manual_seed(5)
    return NSALM(MODEL.model_copy(update={"attention": attention}), NSA).to(device)


def _batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 256, (2, S), generator=g).to(device), torch.randint(0, 256, (2, S), generator=g).to(device)


def _worker(rank: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    try:
        for attention, docs in (("nsa", None), ("dense", None), ("nsa", DOCS), ("dense", DOCS)):
            model = _model(attention, device)
            ids, labels = _batch(device)
            cu = None if docs is None else docs.to(device)
            cp = ContextParallel(dist.group.WORLD, rank, 2)
            model.set_context_parallel(cp)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                res = model(cp.shard(ids), cp.shard(labels), cu_seqlens=cu)
            assert res.loss is not None
            res.loss.backward()
            grads, loss = reduced(model, res.loss, 2)
            report: dict[str, float] = {}
            if rank == 0:  # the whole sequence on this GPU alone, the same weights and data
                whole = _model(attention, device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    ref = whole(ids, labels, cu_seqlens=cu)
                assert ref.loss is not None
                ref.loss.backward()
                report["loss"] = abs(loss - float(ref.loss))
                report["logits"] = _rel(res.logits, ref.logits[:, cp.positions(S, device)])
                report["grads"] = max(_rel(g, p.grad) for g, p in zip(grads, whole.parameters(), strict=True)
                                      if p.grad is not None)
            out.put((attention if docs is None else f"{attention} + documents", rank, report))
    finally:
        dist.destroy_process_group()


def test_context_parallel_over_two_gpus_is_the_whole_model_in_bf16() -> None:
    """Seed 5 weights, seed 11 data, bf16 autocast: rank 0's logits, the mean loss and every reduced gradient
    against one GPU running the whole 4096 positions, NSA (Triton kernels) and dense, with and without packed
    documents that cross the chunks (:data:`DOCS`)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in range(8)]
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    for attention, rank, report in results:
        if rank == 0:
            assert report["loss"] < 2e-2 and report["logits"] < 2e-2 and report["grads"] < 5e-2, (attention, report)


def _gpus(n: int) -> dict[str, str]:
    return {**_env(), "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n))}


def _ok(args: list[str], gpus: int) -> str:
    res = subprocess.run(args, env=_gpus(gpus), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def _losses(run: Path) -> list[float]:
    with open(run / "training.csv", newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


# eager: these check what the ranks compute and save, not speed (compiling each of the runs would triple the time)
GPU = ["--set", "runtime.device=cuda", "--set", "runtime.compile=false", "--set", "eval.every=0",
       "--set", "checkpoint.every=3"]


def test_context_parallel_trainer_on_two_gpus_trains_like_one(tmp_path: Path) -> None:
    """``nsa train --nproc-per-node 2 --context-parallel 2`` on two GPUs against one GPU holding the sequence, in
    fp32 with TF32 off (bf16 would hide a difference under its rounding): step 1, the same weights and data, is
    the same loss to float rounding; the six steps stay within what the optimizer makes of that rounding."""
    one, two = tmp_path / "one", tmp_path / "two"
    fp32 = ["--set", "runtime.precision=fp32", "--set", "runtime.tf32=false"]
    _ok(cmd("--steps", "6", *GPU, *fp32, "--out-dir", str(one)), gpus=1)
    said = _ok(cmd("--steps", "6", *GPU, *fp32, "--out-dir", str(two), "--nproc-per-node", "2", "--context-parallel",
                   "2"), gpus=2)
    assert "(1 data x 2 context)" in said
    assert len(_losses(two)) == len(_losses(one)) == 6
    assert _losses(two)[0] == pytest.approx(_losses(one)[0], rel=1e-5)
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-3)


def _steps(run: Path) -> list[int]:
    with open(run / "training.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def test_checkpoints_move_between_gpu_counts_and_ddp_fsdp(tmp_path: Path) -> None:
    """DDP on two GPUs, 6 steps of 8 sequences a rank, checkpoint at 3; from that checkpoint: DDP on two GPUs
    again (the same losses), FSDP on two GPUs (the same world: the losses within float rounding of reduction
    order), one GPU (a one-line note about the data position: it reads rank 0's sequences, so its losses follow
    the two-GPU run's curve within the spread of batches, ~1%, while weights not restored would start from the
    untrained loss, ~5% above), and from the one-GPU checkpoint FSDP and DDP on two GPUs again (the same world:
    the same losses to reduction order)."""
    ddp, again, fsdp, one, back, back_ddp = (tmp_path / n for n in ("ddp", "again", "fsdp", "one", "back", "back-ddp"))
    two = ["--nproc-per-node", "2"]
    run = [*GPU, "--batch-size", "8"]
    _ok(cmd("--steps", "6", *run, *two, "--out-dir", str(ddp)), gpus=2)
    ckpt = str(ddp / "checkpoints" / "step_00000003")
    _ok(cmd("--steps", "6", *run, *two, "--out-dir", str(again), "--resume", ckpt), gpus=2)
    assert _steps(again) == [4, 5, 6] and _losses(again) == pytest.approx(_losses(ddp)[3:], rel=1e-6)
    _ok(cmd("--steps", "6", *run, *two, "--set", "runtime.parallel=fsdp", "--out-dir", str(fsdp), "--resume", ckpt),
        gpus=2)
    assert _steps(fsdp) == [4, 5, 6] and _losses(fsdp) == pytest.approx(_losses(ddp)[3:], rel=1e-3)
    said = _ok(cmd("--steps", "6", *run, "--out-dir", str(one), "--resume", ckpt), gpus=1)
    assert "resumed a checkpoint of 2 data rank(s) on 1" in said
    assert _steps(one) == [4, 5, 6] and _losses(one) == pytest.approx(_losses(ddp)[3:], rel=2e-2)
    src = str(one / "checkpoints" / "step_00000006")
    _ok(cmd("--steps", "9", *run, *two, "--set", "runtime.parallel=fsdp", "--out-dir", str(back), "--resume", src),
        gpus=2)
    _ok(cmd("--steps", "9", *run, *two, "--out-dir", str(back_ddp), "--resume", src), gpus=2)
    assert _steps(back) == _steps(back_ddp) == [7, 8, 9]
    assert _losses(back) == pytest.approx(_losses(back_ddp), rel=1e-3)
