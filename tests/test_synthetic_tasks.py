"""The needle and MQAR tasks: generators (exact placement, answers that depend on the needle), the
synthetic training sources built on them, answer-only loss, and the trainer's answer columns."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nsa.data import DataConfig, build_loader, get_tokenizer
from nsa.data.retrieval import TaskLayout, mqar_episode, needle_episode, needle_position
from nsa.errors import ConfigError, DataError
from nsa_cli.app import app

LAYOUT = TaskLayout.for_vocab(256, eot_id=0)


def test_layout_puts_keys_and_values_at_the_top_of_the_vocabulary() -> None:
    assert LAYOUT.values == tuple(range(224, 256)) and LAYOUT.keys == tuple(range(192, 224))
    assert LAYOUT.filler_max == 192
    filler = LAYOUT.filler(torch.Generator().manual_seed(0), 20_000)
    assert int(filler.min()) >= 1 and int(filler.max()) < 192  # never eot (0), a key or a value
    gpt2 = TaskLayout.for_vocab(50257, eot_id=50256)
    assert 50256 not in gpt2.keys + gpt2.values and max(gpt2.values) == 50255
    text = torch.tensor([72, 105, 0, 195, 230, 33])
    assert LAYOUT.clean(text).tolist() == [72, 105, 32, 32, 32, 33]  # only the needle may read as a key
    with pytest.raises(ConfigError, match="too small"):
        TaskLayout.for_vocab(40, eot_id=0)


@pytest.mark.parametrize(("context", "depth", "want"), [(100, 0.0, 0), (100, 1.0, 96), (100, 0.5, 48),
                                                       (4096, 0.25, 1023), (6, 1.0, 2)])
def test_needle_sits_exactly_at_its_depth(context: int, depth: float, want: int) -> None:
    assert needle_position(context, depth) == want
    tokens, answers = needle_episode(LAYOUT, torch.Generator().manual_seed(context), context, depth)
    assert answers == [context - 2] and tokens.shape == (context,)
    key, value = int(tokens[-2]), int(tokens[-1])
    assert key in LAYOUT.keys and value in LAYOUT.values
    assert int(tokens[want]) == key and int(tokens[want + 1]) == value
    keys_before = [t for t in range(context - 2) if int(tokens[t]) in LAYOUT.keys]
    assert keys_before == [want]  # the needle is the only key in the haystack: the answer depends on it


def test_needle_rejects_bad_depths_and_contexts() -> None:
    with pytest.raises(ConfigError, match=r"depth=1\.5"):
        needle_position(100, 1.5)
    with pytest.raises(ConfigError, match="context=5"):
        needle_position(5, 0.5)


def test_mqar_pairs_are_scattered_and_every_asked_key_has_its_value() -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        tokens, answers = mqar_episode(LAYOUT, gen, 96, pairs=6, queries=4)
        region = 96 - 8
        assert answers == [88, 90, 92, 94]
        bound = {}
        for t in range(region):
            if int(tokens[t]) in LAYOUT.keys:
                assert t % 2 == 0 and int(tokens[t + 1]) in LAYOUT.values
                bound[int(tokens[t])] = int(tokens[t + 1])
        assert len(bound) == 6  # distinct keys
        for t in answers:
            assert bound[int(tokens[t])] == int(tokens[t + 1])
    with pytest.raises(ConfigError, match="too short"):
        mqar_episode(LAYOUT, gen, 16, pairs=8)


@pytest.mark.parametrize("task", ["needle", "mqar"])
def test_synthetic_sources_train_on_answers_only(task: str) -> None:
    cfg = DataConfig(source="synthetic", synthetic_task=task, synthetic_pairs=4, prefetch_depth=0, loss_on="answers")
    with build_loader(cfg, get_tokenizer("byte"), seq_len=64, batch_size=8, seed=3) as loader:
        x, y = next(loader)
        mask = loader.answer_mask
    assert mask is not None and int(mask.sum()) == (1 if task == "needle" else 4)
    assert (y[:, ~mask] == -100).all()
    for row in range(8):
        for t in mask.nonzero().flatten().tolist():
            key, value = int(x[row, t]), int(y[row, t])
            earlier = [p for p in range(t - 1) if int(x[row, p]) == key and p < 64 - 2 * int(mask.sum())]
            assert len(earlier) == 1 and int(x[row, earlier[0] + 1]) == value
    with build_loader(cfg, get_tokenizer("byte"), seq_len=64, batch_size=1, seed=3) as loader:
        x1, y1 = next(loader)
    assert (x1 >= 0).all() and (y1[:, ~mask] == -100).all()  # one row: the inputs are not masked with y
    if task == "needle":  # random depths: the needle moves between episodes
        depths = {next(p for p in range(62) if int(x[r, p]) in LAYOUT.keys) for r in range(8)}
        assert len(depths) > 4


def test_answer_loss_needs_a_task_with_answers(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="loss_on=answers needs a task with answers"):
        build_loader(DataConfig(loss_on="answers", prefetch_depth=0), get_tokenizer("byte"), seq_len=32,
                     batch_size=2, seed=0)
    res = CliRunner().invoke(app, ["train", "--config", "tiny", "--steps", "2", "--out-dir", str(tmp_path / "r"),
                                   "--set", "data.loss_on=answers"], env={})
    assert res.exit_code == 2 and "loss_on=answers" in res.output and len(res.output.strip().splitlines()) == 1


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "training.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_trainer_reports_answer_loss_and_accuracy(tmp_path: Path) -> None:
    from nsa.train.trainer import Trainer
    from tests.conftest import events, quiet, resolve

    run = tmp_path / "needle"
    Trainer(resolve(run, 3, eval__every=0, data__source="synthetic", data__synthetic_task="needle"),
            reporter=quiet()).fit()
    rows = _rows(run)
    assert all(0 < float(r["answer_loss"]) < 20 and 0 <= float(r["answer_acc"]) <= 1 for r in rows)
    progress = [e for e in events(run) if e["event"] == "progress"]
    assert progress[-1]["answer_loss"] == pytest.approx(float(rows[-1]["answer_loss"]))
    answers_only = tmp_path / "answers"
    Trainer(resolve(answers_only, 2, eval__every=0, data__source="synthetic", data__synthetic_task="mqar",
                    data__synthetic_pairs=2, data__loss_on="answers"), reporter=quiet()).fit()
    for r in _rows(answers_only):
        assert float(r["loss"]) == pytest.approx(float(r["answer_loss"]), rel=1e-5)
    text = tmp_path / "text"
    Trainer(resolve(text, 2, eval__every=0), reporter=quiet()).fit()
    assert all(r["answer_loss"] == "" and r["answer_acc"] == "" for r in _rows(text))
