"""The NSA model learns long-range retrieval (issue: "NSA models do not learn a long-range retrieval").

The learning test trains three 2-layer models from scratch on the CPU (fixed seeds, one thread) on
key/value retrieval whose needle sits beyond the sliding window: the same model with dense attention,
the NSA model with the default layer, and NSA with its window branch alone. It guards the default: with
the gates NSA shipped first (every gate at 0.5 from the start, learned at the full rate) this model
needed 1.43x the dense model's steps; with the window-dominant gates on the paper's layer (one query,
every K/V at the same speed) it did not learn in 1,000 steps (docs/design.md, "Gates against retrieval").
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import torch

from nsa.bench.retrieval import RetrievalCurve, RetrievalPoint, RetrievalRecipe, learn_retrieval
from nsa.config import ModelConfig, NSAConfig
from nsa.data.retrieval import RetrievalTask
from nsa.errors import ConfigError
from tests.conftest import Job, run_job


def test_retrieval_task_puts_the_needle_beyond_the_gap() -> None:
    task = RetrievalTask(seq_len=40, gap=20)
    x, y = task.batch(torch.Generator().manual_seed(3), 64)
    assert x.shape == y.shape == (64, 40)
    assert (y[:, :-1] == -100).all() and ((y[:, -1] >= 32) & (y[:, -1] < 64)).all()
    key, value = x[:, -1], y[:, -1]
    assert (key < 32).all()
    for row in range(64):
        keys = (x[row, :-1] < 32).nonzero().flatten().tolist()
        assert len(keys) == 1  # one pair in the filler, and the query
        p = keys[0]
        assert p % 2 == 0 and x[row, p] == key[row] and x[row, p + 1] == value[row]
        assert (39 - (p + 1)) >= 20  # the value is at least `gap` positions before the query
        filler = torch.cat([x[row, :p], x[row, p + 2 : -1]])
        assert ((filler >= 64) & (filler < 256)).all()
    again, _ = task.batch(torch.Generator().manual_seed(3), 64)
    assert torch.equal(x, again)


def test_retrieval_task_rejects_a_gap_that_does_not_fit() -> None:
    with pytest.raises(ConfigError, match="gap=62"):
        RetrievalTask(seq_len=64, gap=62)


MODEL = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=8, mlp_hidden=128,
                    max_seq_len=128)
NSA = NSAConfig(l=8, d=4, l_sel=16, n_sel=4, w=16)  # selection covers 64 of 128 positions; gates etc. the LM default
TASK = RetrievalTask(seq_len=128, gap=48)  # the needle is >= 48 back, the window 16
RECIPE = RetrievalRecipe(steps=1000, eval_every=50, eval_samples=128, target=0.5, stop_at_target=True)


def _curves() -> None:
    """The job of the learning test (a process of its own, one thread, beside the other tests): dense; the
    default NSA layer within 1.5x dense's steps; the window alone for as many steps as the slower of the two
    needed, rounded up to the next evaluation (its learning rate does not depend on the budget, so these are
    the points its full 1,000-step run has up to there). Prints the curves as one JSON line (``None`` for
    those not run once a model missed its target)."""
    torch.set_num_threads(1)
    dense = learn_retrieval(MODEL, NSA, TASK, "dense", recipe=RECIPE, device="cpu")
    sparse = window = None
    if dense.steps_to_target is not None:
        short = replace(RECIPE, steps=int(1.5 * dense.steps_to_target))
        sparse = learn_retrieval(MODEL, NSA, TASK, "nsa", recipe=short, device="cpu", backend="torch")
    if dense.steps_to_target is not None and sparse is not None and sparse.steps_to_target is not None:
        learned = max(dense.steps_to_target, sparse.steps_to_target)
        steps = min(RECIPE.steps, -(-learned // RECIPE.eval_every) * RECIPE.eval_every)
        window = learn_retrieval(MODEL, NSA, TASK, "window", recipe=replace(RECIPE, steps=steps), device="cpu",
                                 backend="torch")
    print(json.dumps([None if c is None else c.to_dict() for c in (dense, sparse, window)]))


def _curve(d: dict[str, Any]) -> RetrievalCurve:
    return RetrievalCurve(**{**d, "points": [RetrievalPoint(**p) for p in d["points"]]})


CURVES_JOB = Job("from tests.test_retrieval_learning import _curves\n_curves()\n", interpret=False, timeout=900)


@pytest.mark.timeout(900)
@pytest.mark.beside(CURVES_JOB)
def test_nsa_learns_retrieval_beyond_its_window_like_dense() -> None:
    """The default NSA layer (window-dominant gates, the window's own query, kv_speed 3) reaches 50%
    accuracy within 1.5x the dense model's steps (measured at seed 0: 850 vs 700; over seeds 0-7 it
    reached 50% in all 8 at 1.26x dense's mean steps, where the window gates on the paper's layer reached
    it in none: docs/design.md, "Gates against retrieval"); the window alone stays at chance (below 15%,
    measured at most 5.5%) for as many steps as the slower of the two needed. Seed 0, one thread; the three
    models train one after another in a process beside the other tests (about five minutes of one core)."""
    assert NSA.retrieval_concern() is None
    dense, sparse, window = (None if c is None else _curve(c)
                             for c in json.loads(run_job(CURVES_JOB).stdout.strip().splitlines()[-1]))
    assert dense.steps_to_target is not None, [p.accuracy for p in dense.points]
    assert sparse.steps_to_target is not None, (dense.steps_to_target, [p.accuracy for p in sparse.points])
    learned = max(dense.steps_to_target, sparse.steps_to_target)
    seen = [p for p in window.points if p.step <= learned]
    assert seen[-1].step == learned
    assert max(p.accuracy for p in seen) < 0.15
