"""Context parallelism (issue 32; nsa/model/context.py): the head/tail layout, and the split model against the
whole one in float64: logits of every rank's rows, the loss and every gradient, alone (two chunks with
``q_start``) and over two CPU gloo ranks; the trainer over two context ranks against one rank."""

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
from nsa.model.context import ContextParallel, in_position_order
from nsa.model.diagnostics import ScorerParams
from nsa.model.lm import NSALM
from tests.conftest import free_port
from tests.test_train_process import _env, cmd, run_all_ok, run_ok

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=8, mlp_hidden=64,
                    max_seq_len=96)
NSA = NSAConfig(l=8, d=4, l_sel=8, n_sel=3, w=12)
S = 48  # 2 chunks of 24 alone, 4 of 12 over two ranks, 6 of 8 over three


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_head_tail_layout_covers_every_position_once(size: int) -> None:
    ranks = [ContextParallel(None if size == 1 else object(), r, size) for r in range(size)]
    seen = torch.cat([cp.positions(S) for cp in ranks])
    assert sorted(seen.tolist()) == list(range(S))
    c = S // (2 * size)
    assert ranks[0].chunks(S) == [(0, c), (S - c, S)]  # the first rank: the head and the tail
    assert all(len(cp.positions(S)) == S // size for cp in ranks)
    x = torch.arange(2 * S).view(2, S)
    assert torch.equal(ranks[-1].shard(x), x[:, ranks[-1].positions(S)])
    assert torch.equal(in_position_order(seen, size), torch.arange(S))  # what gather does with the ranks' rows


def test_layout_refuses_what_does_not_split() -> None:
    with pytest.raises(ValueError, match="does not split into 4 equal chunks"):
        ContextParallel(object(), 0, 2).chunks(50)
    with pytest.raises(ValueError, match="process group"):
        ContextParallel(None, 0, 2)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        ContextParallel(object(), 2, 2)


def _models(attention: str, seed: int = 5) -> tuple[NSALM, NSALM]:
    torch.manual_seed(seed)
    update = {"attention": "nsa", "dense_layers": [0]} if attention == "hybrid" else {"attention": attention}
    cfg = MODEL.model_copy(update=update)
    whole = NSALM(cfg, NSA, backend="torch").double()
    split = NSALM(cfg, NSA, backend="torch").double()
    split.load_state_dict(whole.state_dict())
    return whole, split


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, S), generator=g)
    return ids, torch.randint(0, 64, (2, S), generator=g)


# packed documents over the [2, 48] batch: documents that run across the boundaries of the chunks of 24 (one
# rank) and of 12 (two ranks), one that starts exactly at a chunk (60 = 48 + 12), one a token long, one
# shorter than a compression block (5 < l = 8)
DOCS = torch.tensor([0, 5, 20, 30, 48, 60, 61, 90, 96], dtype=torch.int32)
# documents long enough to choose blocks (more than n_sel * l_sel = 24 tokens), for the alignment loss: one from
# the start of row 0 (40 tokens), one from position 2 of row 1 (46 tokens); their probe positions (24-39 of each,
# positions 24-39 and 26-41 of the rows) cross the chunks of 12 (two ranks), and each document runs over chunks
LONG_DOCS = torch.tensor([0, 40, 48, 50, 96], dtype=torch.int32)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("attention", ["nsa", "dense", "hybrid"])
def test_one_rank_in_two_chunks_is_the_whole_model(attention: str, documents: bool) -> None:
    """Seed 5 weights, seed 7 data: the chunked forward (queries at an offset) equals the whole one, with
    packed documents too (``cu_seqlens`` of the whole batch: each chunk attends within its documents)."""
    whole, split = _models(attention)
    ids, labels = _data(7)
    cu = DOCS if documents else None
    cp = ContextParallel(None, 0, 1)
    split.set_context_parallel(cp)
    logits = _split_is_whole(whole, split, cp, ids, labels, cu)
    split.set_context_parallel(None)
    assert torch.allclose(split(ids, cu_seqlens=cu).logits, logits, atol=1e-12, rtol=0)


def _split_is_whole(whole: NSALM, split: NSALM, cp: ContextParallel, ids: torch.Tensor, labels: torch.Tensor,
                    cu: torch.Tensor | None = None) -> torch.Tensor:
    """Forward and backward of both; ``split`` (one rank in chunks) has the whole model's logits at its
    positions, loss and every gradient, in float64. Returns the whole model's logits."""
    a, b = whole(ids, labels, cu_seqlens=cu), split(cp.shard(ids), cp.shard(labels), cu_seqlens=cu)
    assert torch.allclose(b.logits, a.logits[:, cp.positions(S)], atol=1e-12, rtol=0)
    assert b.loss is not None and a.loss is not None
    assert torch.allclose(b.loss, a.loss, atol=1e-12, rtol=0)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(whole.named_parameters(), split.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(q.grad, p.grad, atol=1e-12, rtol=0), name
    return a.logits


@pytest.mark.parametrize("attention", ["dense", "hybrid"])
def test_dense_chunks_by_the_library_path_are_the_whole_model(attention: str) -> None:
    """The dense blocks' chunks as the prefix and the chunk's own square merged by lse (the path a CUDA GPU
    of compute capability 9+ takes, here in plain ops: ``chunk_attention.set_impl("math")``): the whole model's
    logits, loss and every gradient in float64 (seed 5 weights, seed 7 data)."""
    from nsa.ops import chunk_attention

    whole, split = _models(attention)
    ids, labels = _data(7)
    cp = ContextParallel(None, 0, 1)
    split.set_context_parallel(cp)
    chunk_attention.set_impl("math")
    try:
        _split_is_whole(whole, split, cp, ids, labels)
    finally:
        chunk_attention.set_impl(None)


@pytest.mark.parametrize("cu", [None, LONG_DOCS], ids=["sequence", "documents"])
def test_alignment_loss_in_chunks_is_the_whole_models(cu: torch.Tensor | None) -> None:
    """Seed 5 weights, seed 7 data, float64, the alignment loss on (weight 0.5, 16 probe positions): one rank in
    two chunks gives the whole model's loss, every gradient and the loss's running mean (``align_nll``); the
    same model without the loss differs (the loss reaches the gradients). Over packed documents
    (:data:`LONG_DOCS`) each document has its own probe positions, its mean weighted by its share of the tokens
    (split between ranks' chunks in the gloo test)."""
    whole, split = _models("nsa")
    ids, labels = _data(7)
    cp = ContextParallel(None, 0, 1)
    split.set_context_parallel(cp)
    grads = []
    for align in (0.5, 0.0):
        for m in (whole, split):
            m.zero_grad()
            m.set_scorer(ScorerParams(16, 0.0, "query_and_keys", align))
        _split_is_whole(whole, split, cp, ids, labels, cu)
        grads.append([p.grad.clone() for p in whole.parameters() if p.grad is not None])
        if align:  # the running means of the loss, as training telemetry reads them
            means = [m.consume_stats()["align_nll"] for m in (whole, split)]
            assert means[0] == pytest.approx(means[1], rel=1e-12, abs=0) and means[0] > 0
    assert max(float((x - y).norm()) for x, y in zip(*grads, strict=True)) > 1e-6


def reduced(model: torch.nn.Module, loss: torch.Tensor, size: int) -> tuple[list[torch.Tensor], float]:
    """After the backward: every gradient and the loss all-reduced and averaged over the ``size`` ranks (the
    data-parallel reduction: the mean of the rows' means)."""
    grads = []
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        grads.append(p.grad / size)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return grads, float(total) / size


def _cases(attentions: list[str]) -> list[tuple[str, torch.Tensor | None, float]]:
    """(attention, packed documents, alignment loss weight) of the gloo test: each attention alone and over
    :data:`DOCS`, NSA also with the alignment loss (whose probe positions fall on both ranks' chunks), alone
    and over :data:`LONG_DOCS`."""
    return [(a, cu, 0.0) for a in attentions for cu in (None, DOCS)] + [
        ("nsa", cu, 0.5) for cu in (None, LONG_DOCS) if "nsa" in attentions]


def _worker(rank: int, size: int, port: int, attentions: list[str], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        for attention, cu, align in _cases(attentions):
            _, split = _models(attention)
            split.set_scorer(ScorerParams(16, 0.0, "query_and_keys", align))
            ids, labels = _data(11)
            cp = ContextParallel(dist.group.WORLD, rank, size)
            split.set_context_parallel(cp)
            res = split(cp.shard(ids), cp.shard(labels), cu_seqlens=cu)
            assert res.loss is not None
            res.loss.backward()
            grads, loss = reduced(split, res.loss, size)
            # numpy arrays travel by value (tensors would travel as handles to memory of a finished process)
            out.put((attention, cu is not None, align, rank, cp.positions(S).numpy(), res.logits.detach().numpy(),
                     loss, [g.numpy() for g in grads] if rank == 0 else None))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("size", "attentions"), [(2, ["nsa", "dense"])])
def test_split_over_gloo_ranks_is_the_whole_model(size: int, attentions: list[str]) -> None:
    """Seed 5 weights, seed 11 data, float64: each rank's logits are the whole model's at its positions, the
    mean of the ranks' losses is the whole loss, and their reduced gradients are the whole gradients; the same
    with packed documents (:data:`DOCS`) that cross the ranks' chunks, and with the alignment loss (its probe
    positions on both ranks: each rank's share of the whole sequence's mean), alone and over packed documents."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, size, port, attentions, q)) for r in range(size)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in range(size * len(_cases(attentions)))]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for attention, cu, align in _cases(attentions):
        documents = cu is not None
        whole, _ = _models(attention)
        whole.set_scorer(ScorerParams(16, 0.0, "query_and_keys", align))
        ids, labels = _data(11)
        ref = whole(ids, labels, cu_seqlens=cu)
        assert ref.loss is not None
        ref.loss.backward()
        for att, docs, al, rank, pos, logits, loss, grads in results:
            if (att, docs, al) != (attention, documents, align):
                continue
            assert torch.allclose(torch.from_numpy(logits), ref.logits.detach()[:, torch.from_numpy(pos)],
                                  atol=1e-12, rtol=0), (attention, rank)
            assert loss == pytest.approx(float(ref.loss.detach()), abs=1e-12)
            if grads is not None:
                for (name, p), g in zip(whole.named_parameters(), grads, strict=True):
                    assert p.grad is not None
                    assert torch.allclose(torch.from_numpy(g), p.grad, atol=1e-12, rtol=0), (attention, name)


def _losses(run: Path) -> list[float]:
    with open(run / "training.csv", newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.mark.slow
def test_nsa_train_over_two_context_ranks_trains_like_one_rank_and_resumes_on_one(tmp_path: Path) -> None:
    """``nsa train --nproc-per-node 2 --context-parallel 2`` (gloo, CPU): one sequence over two ranks gives the
    losses of one rank holding it all (fp32, same data: the loaders are per data rank), evaluates alike, says
    the layout, and its checkpoint resumes on one rank with the losses after it."""
    common = ["--steps", "4", "--set", "checkpoint.every=2", "--set", "eval.every=2", "--set", "eval.batches=2"]
    one, two, back = tmp_path / "one", tmp_path / "two", tmp_path / "back"
    _, res = run_all_ok(cmd(*common, "--out-dir", str(one)),
                        cmd(*common, "--out-dir", str(two), "--nproc-per-node", "2", "--context-parallel", "2"))
    said = res.stdout + res.stderr
    assert "2 rank(s) (1 data x 2 context)" in said and "each sequence of 32 positions over 2 ranks" in said
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-4)
    with open(two / "val.csv", newline="") as f:
        val_two = [float(r["val_loss"]) for r in csv.DictReader(f)]
    with open(one / "val.csv", newline="") as f:
        val_one = [float(r["val_loss"]) for r in csv.DictReader(f)]
    assert val_two == pytest.approx(val_one, rel=1e-4)
    run_ok(cmd(*common, "--out-dir", str(back), "--resume", str(two / "checkpoints" / "step_00000002")))
    assert _losses(back) == pytest.approx(_losses(one)[2:], rel=1e-4)


@pytest.mark.slow
def test_context_parallelism_composes_with_data_parallel_fsdp(tmp_path: Path) -> None:
    """Four gloo ranks as 2 data x 2 context with FSDP2 over all four train like two data ranks holding whole
    sequences (the same data: the loaders are per data rank; the gradients are the sequences' either way), with
    packed documents (``data.document_mask``: windows of 256 bytes of ~370-byte documents, so documents cross
    the chunks of 64; the boundaries come from the whole batch, each rank holding only its rows)."""
    common = ["--steps", "3", "--seq-len", "256", "--set", "data.document_mask=true", "--set", "eval.every=0",
              "--set", "checkpoint.every=0"]
    dp, grid = tmp_path / "dp", tmp_path / "grid"
    _, res = run_all_ok(cmd(*common, "--out-dir", str(dp), "--nproc-per-node", "2"),
                        cmd(*common, "--out-dir", str(grid), "--nproc-per-node", "4", "--context-parallel", "2",
                            "--set", "runtime.parallel=fsdp"))
    assert "4 rank(s) (2 data x 2 context)" in res.stdout + res.stderr
    assert _losses(grid) == pytest.approx(_losses(dp), rel=1e-4)


def test_context_parallel_settings_that_cannot_work_are_one_line(tmp_path: Path) -> None:
    from nsa.config import load_run_config
    from nsa.errors import NSAError
    from nsa.train.trainer import Trainer
    from tests.conftest import quiet, resolve

    bad = {
        ("train.seq_len=40", "runtime.context_parallel=3"): "must split into 6 equal chunks",
        ("scorer.weight=0.1", "runtime.context_parallel=2"): "scorer loss",
    }
    for sets, want in bad.items():
        with pytest.raises(NSAError, match=want):
            load_run_config("tiny", environ={}, sets=list(sets))
    # the default recipe's alignment loss: on, under context parallelism too, over packed documents as well
    for sets in ([], ["runtime.context_parallel=2"], ["runtime.context_parallel=2", "data.document_mask=true"]):
        assert load_run_config("tiny", environ={}, sets=sets).config.scorer.align == 0.1, sets
    with pytest.raises(NSAError, match=r"context_parallel=2 must divide the 1 rank\(s\)"):
        Trainer(resolve(tmp_path / "x", 2, runtime__context_parallel=2), reporter=quiet())
    res = subprocess.run(cmd("--steps", "2", "--out-dir", str(tmp_path / "y"), "--context-parallel", "2"),
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "must divide the 1 rank(s)" in res.stderr, res.stderr[-500:]
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
