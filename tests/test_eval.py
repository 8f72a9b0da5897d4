"""``nsa eval``: retrieval scores depend on the needle (stub models whose answers we know), exact depth
placement, held-out loss, the CLI end to end on a tiny trained run, bad input, and ``nsa report``."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

from nsa.config import load_named
from nsa.data.retrieval import TaskLayout, needle_position
from nsa.errors import ConfigError
from nsa.eval.tasks import check_contexts, eval_loss, eval_mqar, eval_needle, position_buckets
from nsa.model.lm import NSALM, LMOutput
from nsa.rundir.records import EvalResult
from nsa_cli.app import app

LAYOUT = TaskLayout.for_vocab(256, 0)  # the byte vocabulary: keys 192..223, values 224..255
CPU = torch.device("cpu")
runner = CliRunner()


class Oracle(nn.Module):
    """Predicts the token after the last earlier occurrence of the current token (only ``window``
    positions back when given): perfect retrieval, or retrieval that cannot see far back."""

    def __init__(self, vocab: int = 256, window: int | None = None) -> None:
        super().__init__()
        self.vocab, self.window = vocab, window
        self.seen: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor) -> LMOutput:
        self.seen.append(input_ids.clone())
        S = input_ids.shape[1]
        t = torch.arange(S)
        earlier = t[None, :] < t[:, None]  # [t, j]: j < t
        if self.window is not None:
            earlier &= t[:, None] - t[None, :] <= self.window
        match = (input_ids[:, :, None] == input_ids[:, None, :]) & earlier
        score = torch.where(match, t + 1, 0)  # the latest match scores highest
        found, last = score.max(-1).values > 0, score.argmax(-1)
        pred = torch.where(found, input_ids.gather(1, (last + 1).clamp(max=S - 1)), 0)
        return LMOutput(F.one_hot(pred, self.vocab).float())


class Recency(nn.Module):
    """Predicts the most recent value-range token at or before each position: right for a single
    needle, right in MQAR only when the asked pair is the latest one (or by a value collision)."""

    def __init__(self, layout: TaskLayout, vocab: int = 256) -> None:
        super().__init__()
        self.values, self.vocab = torch.tensor(layout.values), vocab

    def forward(self, input_ids: torch.Tensor) -> LMOutput:
        S = input_ids.shape[1]
        idx = torch.where(torch.isin(input_ids, self.values), torch.arange(S) + 1, 0).cummax(1).values
        pred = torch.where(idx > 0, input_ids.gather(1, (idx - 1).clamp(min=0)), 0)
        return LMOutput(F.one_hot(pred, self.vocab).float())


def _accs(rows: list[dict]) -> dict[tuple[int, float], float]:
    return {(r["context"], r["depth"]): r["accuracy"] for r in rows}


# ---------------------------------------------------------------------------------------------
# library: scores depend on the needle


def test_oracle_retrieves_at_every_depth_and_context() -> None:
    depths = [0, 0.25, 0.5, 0.75, 1]
    rows = eval_needle(Oracle(), LAYOUT, [16, 64], depths, samples=8, seed=0, device=CPU)
    assert [(r["context"], r["depth"]) for r in rows] == [(c, float(d)) for c in (16, 64) for d in depths]
    assert all(r["accuracy"] == 1.0 and r["n"] == 8 for r in rows)
    mqar = eval_mqar(Oracle(), LAYOUT, [64, 128], samples=6, pairs=8, queries=8, seed=0, device=CPU)
    assert mqar == [{"context": 64, "accuracy": 1.0, "n": 48}, {"context": 128, "accuracy": 1.0, "n": 48}]
    # a real-text-like haystack full of key/value ids: cleaned, so the needle stays the only pair
    text = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(0))
    rows = eval_needle(Oracle(), LAYOUT, [64], [0, 1], samples=6, device=CPU, haystack="text", text_tokens=text)
    assert all(r["accuracy"] == 1.0 for r in rows)


def test_short_sighted_model_only_finds_near_needles() -> None:
    rows = eval_needle(Oracle(window=8), LAYOUT, [64], [0, 0.5, 1], samples=8, seed=1, device=CPU)
    assert _accs(rows) == {(64, 0.0): 0.0, (64, 0.5): 0.0, (64, 1.0): 1.0}


def test_recency_model_wins_needle_but_not_mqar() -> None:
    rows = eval_needle(Recency(LAYOUT), LAYOUT, [32], [0, 0.5, 1], samples=8, device=CPU)
    assert all(r["accuracy"] == 1.0 for r in rows)  # one pair: the latest value is the answer
    one = eval_mqar(Recency(LAYOUT), LAYOUT, [32], samples=8, pairs=1, queries=1, device=CPU)
    assert one[0]["accuracy"] == 1.0
    many = eval_mqar(Recency(LAYOUT), LAYOUT, [64], samples=16, pairs=8, queries=8, seed=0, device=CPU)
    assert many[0]["n"] == 128 and many[0]["accuracy"] < 0.2  # ~0.05 expected


def test_window_only_nsa_model_scores_near_chance() -> None:
    """A model that attends only through its window (gates fixed to (0, 0, 1), w=8) cannot see a needle 32 or 62
    tokens back: its logits at the question are the same whatever value the needle holds, so it scores near
    chance. The same model with its compressed and selected branches on (gates (1, 1, 1)) does see the needle:
    its logits there change with the needle's value (an untrained model scores 0 either way, so the accuracy
    alone would not tell)."""
    cfg = load_named("tiny")
    models = {}
    for name, gates in (("window", (0.0, 0.0, 1.0)), ("all", (1.0, 1.0, 1.0))):
        torch.manual_seed(0)
        models[name] = NSALM(cfg.model, cfg.nsa.model_copy(update={"fixed_gates": gates, "w": 8}),
                             backend="torch").train()
    rows = eval_needle(models["window"], LAYOUT, [64], [0, 0.5], samples=16, seed=0, device=CPU, batch_size=8)
    assert all(r["accuracy"] <= 0.25 for r in rows), rows  # chance is 1/32
    assert models["window"].training  # the caller's mode is restored
    probe = Oracle()
    eval_needle(probe, LAYOUT, [64], [0, 0.5], samples=4, seed=0, device=CPU, batch_size=8)
    episodes = torch.cat(probe.seen)
    keys = torch.tensor(LAYOUT.keys)
    needle = torch.isin(episodes, keys).int().argmax(1) + 1  # the value after the first key
    assert sorted(set((needle - 1).tolist())) == [0, 30]  # depths 0 and 0.5 of 64 tokens: 62 and 32 back
    other = episodes.clone()
    rows_ = torch.arange(len(episodes))
    other[rows_, needle] = torch.where(episodes[rows_, needle] == LAYOUT.values[0], LAYOUT.values[1], LAYOUT.values[0])
    with torch.no_grad():
        question = {name: (m.eval()(episodes).logits[:, 62], m(other).logits[:, 62]) for name, m in models.items()}
    assert torch.equal(*question["window"])
    assert not torch.allclose(*question["all"])


@pytest.mark.parametrize(("depth", "where"), [(0.0, 0), (0.5, 14), (1.0, 28)])
def test_needle_sits_exactly_at_its_depth(depth: float, where: int) -> None:
    assert needle_position(32, depth) == where
    probe = Oracle()
    eval_needle(probe, LAYOUT, [32], [depth], samples=3, seed=5, device=CPU, batch_size=2)
    seen = torch.cat(probe.seen)
    assert seen.shape == (3, 32)
    keys, values = torch.tensor(LAYOUT.keys), torch.tensor(LAYOUT.values)
    for row in seen:
        assert torch.isin(row, keys).nonzero().flatten().tolist() == [where, 30]
        assert torch.isin(row, values).nonzero().flatten().tolist() == [where + 1, 31]
        assert row[30] == row[where] and row[31] == row[where + 1]
    # the same episodes whatever the batch size and whichever other depths are asked
    again = Oracle()
    eval_needle(again, LAYOUT, [32], [0.25, depth], samples=3, seed=5, device=CPU, batch_size=6)
    assert torch.equal(torch.cat(again.seen)[3:], seen)


def test_validation_errors_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"depth=1.5 must be in \[0, 1\]"):
        eval_needle(Oracle(), LAYOUT, [32], [0, 1.5], samples=1, device=CPU)
    with pytest.raises(ConfigError, match=r"exceeds the model's model\.max_seq_len=64"):
        eval_needle(Oracle(), LAYOUT, [128], [0], samples=1, device=CPU, max_seq_len=64)
    with pytest.raises(ConfigError, match="too short for the needle task"):
        eval_needle(Oracle(), LAYOUT, [4], [0], samples=1, device=CPU)
    with pytest.raises(ConfigError, match="too short for the mqar task"):
        eval_mqar(Oracle(), LAYOUT, [24], samples=1, pairs=8, queries=8, device=CPU)
    with pytest.raises(ConfigError, match="queries"):
        eval_mqar(Oracle(), LAYOUT, [64], samples=1, pairs=4, queries=5, device=CPU)
    with pytest.raises(ConfigError, match="text_tokens"):
        eval_needle(Oracle(), LAYOUT, [32], [0], samples=1, device=CPU, haystack="text")
    with pytest.raises(ConfigError, match="unknown task"):
        check_contexts([32], "summarise")


# ---------------------------------------------------------------------------------------------
# a tiny trained run, the CLI and the report


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nsa.train.trainer import Trainer
    from tests.conftest import quiet, resolve

    run = tmp_path_factory.mktemp("eval") / "run"
    result = Trainer(resolve(run, 3), reporter=quiet()).fit()
    assert result.status == "completed"
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("tb", "eval"))
    return dst


def _eval(*args: str) -> tuple[int, str, str]:
    res = runner.invoke(app, ["eval", *args])
    return res.exit_code, res.stdout, res.stderr


def test_eval_loss_on_the_val_split(tiny_run: Path) -> None:
    from nsa.data.tokenizers import get_tokenizer
    from nsa.model.load import load_model

    loaded = load_model(tiny_run)
    tok = get_tokenizer("byte")
    rows = eval_loss(loaded.model, loaded.config, tok, [16, 32], batches=2, batch_size=2, device=CPU)
    assert [(r["context"], r["n"]) for r in rows] == [(16, 64), (32, 128)]
    for r in rows:
        assert math.isfinite(r["loss"]) and 3.0 < r["loss"] < 6.5  # near ln(256) = 5.5 after 3 steps
        # bytes <= tokens (separators decode to nothing), and separators are rare in the corpus
        assert r["loss"] / math.log(2) <= r["bits_per_byte"] <= 1.2 * r["loss"] / math.log(2)
    assert eval_loss(loaded.model, loaded.config, tok, [16], batches=2, batch_size=2, device=CPU) == rows[:1]
    for r in rows:  # by position in the window: the ranges cover it and add up to the whole loss
        spans = r["by_position"]
        assert [(b["start"], b["end"]) for b in spans] == position_buckets(r["context"])
        assert sum(b["n"] for b in spans) == r["n"]
        assert abs(sum(b["loss"] * b["n"] for b in spans) / r["n"] - r["loss"]) < 1e-9


def test_eval_loss_reads_a_document_masked_run_document_by_document(tiny_run: Path) -> None:
    """A run trained with ``data.document_mask`` is read as it trained: each packed document on its own (the
    loss equals the model's with the batch's ``cu_seqlens``), not across the separators (it was before: the
    held-out loss of ``nsa eval`` and the bench's shorter windows then differed from training's own)."""
    import torch

    from nsa.data.tokenizers import get_tokenizer
    from nsa.eval.tasks import _val_loader
    from nsa.model.documents import from_separators
    from nsa.model.load import load_model

    loaded = load_model(tiny_run)
    tok = get_tokenizer("byte")
    masked_cfg = loaded.config.model_copy(
        update={"data": loaded.config.data.model_copy(update={"document_mask": True})})
    (masked,) = eval_loss(loaded.model, masked_cfg, tok, [256], batches=2, batch_size=2, device=CPU)
    (whole,) = eval_loss(loaded.model, loaded.config, tok, [256], batches=2, batch_size=2, device=CPU)
    nats, n, seps = 0.0, 0, 0
    with torch.no_grad(), _val_loader(masked_cfg, tok, 256, 2, torch.device(CPU)) as loader:
        for _ in range(2):
            x, y = next(loader)
            seps += int((x == tok.eot_id).sum())
            logits = loaded.model(x, cu_seqlens=from_separators(x, tok.eot_id)).logits.double()
            nats += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                            ignore_index=-100, reduction="sum"))
            n += int((y != -100).sum())
    assert seps > 0 and masked["n"] == whole["n"] == n  # the windows do cross documents
    assert masked["loss"] == pytest.approx(nats / n, rel=1e-5) and masked["loss"] != whole["loss"]


def test_eval_cli_says_a_masked_run_is_read_document_by_document(tmp_path: Path) -> None:
    from nsa.train.trainer import Trainer
    from tests.conftest import quiet, resolve

    run = tmp_path / "run"
    assert Trainer(resolve(run, 2, data__document_mask=True), reporter=quiet()).fit().status == "completed"
    code, stdout, stderr = _eval(str(run), "--task", "loss", "--contexts", "256", "--samples", "2")
    assert code == 0, stderr
    assert "each document on its own" in " ".join(stdout.split())
    assert json.loads((run / "eval" / "loss.json").read_text())["settings"]["documents"] is True


def test_position_buckets_share_their_edges_across_contexts() -> None:
    assert position_buckets(16) == [(0, 16)]
    assert position_buckets(100) == [(0, 64), (64, 100)]
    assert position_buckets(2048) == [(0, 64), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048)]
    assert position_buckets(8192)[:6] == position_buckets(2048)
    assert position_buckets(8192)[6:] == [(2048, 4096), (4096, 8192)]


def test_cli_needle_end_to_end(tiny_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    code, stdout, stderr = _eval(str(tiny_run), "--task", "needle", "--contexts", "16,32", "--depths", "0,0.5,1",
                                 "--samples", "4", "--json-out", str(out))
    assert code == 0, stderr
    data = json.loads(out.read_text())
    assert set(data) == set(EvalResult.__annotations__)  # schema, task, run, checkpoint, step, weights, results, ...
    assert data["step"] == 3 and data["weights"]["sha256"]
    assert data["task"] == "needle" and data["run"] == str(tiny_run)
    assert data["checkpoint"] == str(tiny_run / "export" / "model.safetensors")
    assert [(r["context"], r["depth"]) for r in data["results"]] == [(c, d) for c in (16, 32) for d in (0.0, 0.5, 1.0)]
    for r in data["results"]:
        assert set(r) == {"context", "depth", "accuracy", "n"} and 0.0 <= r["accuracy"] <= 1.0 and r["n"] == 4
    s = data["settings"]
    assert (s["samples"], s["depths"], s["contexts"], s["haystack"], s["seed"]) == (4, [0.0, 0.5, 1.0], [16, 32], "random", 0)
    assert {"torch", "python", "device", "date"} <= set(data["env"])
    saved = tiny_run / "eval" / "needle.json"
    assert json.loads(saved.read_text()) == data
    assert (tiny_run / "eval" / "needle.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "depth \\ context" in stdout and f"saved {saved}" in stdout and f"saved {out}" in stdout
    assert not list((tiny_run / "eval").glob(".*tmp*"))  # written atomically


def test_cli_mqar_and_loss(tiny_run: Path, tmp_path: Path) -> None:
    code, stdout, stderr = _eval(str(tiny_run), "--task", "mqar", "--contexts", "32", "--pairs", "4", "--queries", "4",
                                 "--samples", "4", "--json-out", str(tmp_path / "mqar.json"))
    assert code == 0, stderr
    data = json.loads((tmp_path / "mqar.json").read_text())
    assert data["task"] == "mqar" and (data["settings"]["pairs"], data["settings"]["queries"]) == (4, 4)
    assert [set(r) for r in data["results"]] == [{"context", "accuracy", "n"}] and data["results"][0]["n"] == 16
    assert (tiny_run / "eval" / "mqar.json").is_file() and "keys asked" in stdout

    code, stdout, stderr = _eval(str(tiny_run), "--task", "loss", "--contexts", "16,32", "--samples", "4",
                                 "--json-out", str(tmp_path / "loss.json"))
    assert code == 0, stderr
    rows = json.loads((tmp_path / "loss.json").read_text())["results"]
    assert [r["context"] for r in rows] == [16, 32]
    for r in rows:
        assert set(r) == {"context", "loss", "bits_per_byte", "n", "by_position"}
        assert math.isfinite(r["loss"]) and r["bits_per_byte"] > 0 and r["n"] == 4 * r["context"]
    assert (tiny_run / "eval" / "loss.json").is_file() and "bits/byte" in stdout and "loss by position" in stdout


def test_cli_checkpoint_saves_into_its_run_and_json_to_stdout(tiny_run: Path, tmp_path: Path) -> None:
    run = _copy(tiny_run, tmp_path)
    ckpt = next((run / "checkpoints").iterdir())
    code, stdout, stderr = _eval(str(ckpt), "--task", "needle", "--contexts", "16", "--depths", "1",
                                 "--samples", "2", "--json")
    assert code == 0, stderr
    data = json.loads(stdout)  # tables go to stderr with --json
    assert data["run"] == str(run) and data["checkpoint"] == str(ckpt / "state.pt")
    assert (run / "eval" / "needle.json").is_file() and not (ckpt / "eval").exists()


def test_cli_unwritable_run_dir_warns_and_goes_on(tiny_run: Path, tmp_path: Path) -> None:
    run = _copy(tiny_run, tmp_path)
    (run / "eval").write_text("a file where the eval folder would go\n")  # mkdir fails like a read-only dir
    out = tmp_path / "keep.json"
    code, _, stderr = _eval(str(run), "--task", "mqar", "--contexts", "32", "--pairs", "2", "--samples", "2",
                            "--json-out", str(out))
    assert code == 0, stderr
    warnings = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "cannot write the results" in warnings[0]
    assert json.loads(out.read_text())["task"] == "mqar"


@pytest.mark.parametrize(("args", "message"), [
    (["--task", "haystack"], "unknown task 'haystack'"),
    (["--task", "needle", "--contexts", "100000"], "exceeds the model's model.max_seq_len=65536"),
    (["--task", "needle", "--contexts", "32", "--depths", "0,1.5"], "depth=1.5 must be in [0, 1]"),
    (["--task", "mqar", "--contexts", "16", "--pairs", "8"], "too short for the mqar task"),
    (["--task", "needle", "--contexts", "lots"], "--contexts 'lots' must be comma-separated integers"),
])
def test_cli_bad_input_is_one_line(tiny_run: Path, args: list[str], message: str) -> None:
    code, _, stderr = _eval(str(tiny_run), *args, "--no-save")
    assert code == 2 and stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert message in stderr


def test_cli_path_without_weights(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code, _, stderr = _eval(str(tmp_path / "empty"), "--task", "needle")
    assert code == 2 and stderr.count("\n") == 1 and "has no export/model.safetensors" in stderr


def test_report_shows_the_evaluation(tiny_run: Path, tmp_path: Path) -> None:
    run = _copy(tiny_run, tmp_path)
    for args in (["--task", "needle", "--contexts", "16,32", "--depths", "0,0.5,1", "--samples", "2"],
                 ["--task", "loss", "--contexts", "16", "--samples", "2"]):
        assert _eval(str(run), *args)[0] == 0
    reports = tmp_path / "reports"
    res = runner.invoke(app, ["report", str(run), "--out", str(reports), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    text = Path(info["path"]).read_text()
    section = text.split("### Evaluation", 1)[1].split("### Anomalies and halts", 1)[0]
    assert "#### Needle retrieval" in section and "| depth / context | 16 | 32 |" in section
    assert section.count("\n| 0.5 | ") == 1 and "#### Held-out loss" in section and "| 16 | " in section
    assert "#### Multi-query" not in section  # only the tasks that were run
    png = next(Path(p) for p in info["images"] if p.endswith("needle.png"))
    assert png.is_file() and png.parent.name.startswith(Path(info["path"]).stem[:10])
    assert f"]({png.relative_to(reports).as_posix()})" in section
