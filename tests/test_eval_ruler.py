"""``nsa eval --task ruler``: RULER-style episodes (exact length, seeded), their scoring, the CLI on a run and on
its Hugging Face export, and bad input as one line."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from nsa.data.tokenizers import ByteTokenizer
from nsa.errors import ConfigError
from nsa.eval.ruler import NOISE, RULER_TASKS, grade_episodes, ruler_episode
from nsa_cli.app import app

runner = CliRunner()
TOK = ByteTokenizer()


@pytest.mark.parametrize("task", RULER_TASKS)
@pytest.mark.parametrize("context", [512, 1500])
def test_episodes_have_the_context_and_their_answers(task: str, context: int) -> None:
    """Exactly ``context`` tokens; the values sit at the end, after the question; the facts are in the text; the
    same seed gives the same episode."""
    ep = ruler_episode(task, TOK.encode, context, random.Random(5))
    again = ruler_episode(task, TOK.encode, context, random.Random(5))
    assert ep.tokens.numel() == context and torch.equal(ep.tokens, again.tokens) and ep.values == again.values
    text = TOK.decode(ep.tokens.tolist())
    values = [TOK.decode(ep.tokens[a:b].tolist()) for a, b in ep.values]
    assert ep.values[-1][1] == context and all(v.strip() == v and v for v in values)
    body = TOK.decode(ep.tokens[: ep.values[0][0]].tolist())
    hay, question = body.rsplit("\n", 1)
    noise = set(NOISE.replace(".", "").split())
    if task.startswith("niah"):
        assert all(len(v) == 7 and v.isdigit() and f"is: {v}." in body for v in values)
        assert len(values) == (4 if task in ("niah_multivalue", "niah_multiquery") else 1)
        assert body.count("special magic number") - question.count("special magic number") == (
            1 if task == "niah_single" else 4)
        if task == "niah_multivalue":  # in the order of appearance
            assert sorted(values, key=body.index) == values
    elif task == "vt":
        assert len(values) == 5 and f"VAR {values[1]} = {values[0]}." in body and f"VAR {values[4]} = {values[3]}." in body
    elif task == "cwe":  # the 10 listed words that occur most, by first appearance
        listed = [w for w in hay.replace(". ", " ").split() if w.isalpha() and w not in noise]
        counts = {w: listed.count(w) for w in set(listed)}
        assert set(values) == set(sorted(counts, key=lambda w: -counts[w])[:10])
        assert min(counts[v] for v in values) > max(c for w, c in counts.items() if w not in values)
    else:  # fwe: the 3 most frequent words, most frequent first
        listed = [w for w in hay.replace(".", " ").split() if w.isalpha() and w not in noise]
        counts = [listed.count(v) for v in values]
        assert counts == sorted(counts, reverse=True) and len(set(counts)) == 3
        assert counts[-1] > max(listed.count(w) for w in set(listed) - set(values))
    assert text.endswith(" ".join(values) if task in ("vt", "cwe", "fwe") else ", ".join(values))


def test_facts_go_between_noise_sentences_and_text_haystacks_are_read() -> None:
    ep = ruler_episode("vt", TOK.encode, 900, random.Random(2))
    body = TOK.decode(ep.tokens.tolist())
    assert all(part.startswith(" VAR") or part.startswith("VAR") for part in body.split(". ")[1:] if "VAR" in part)
    text = torch.tensor(TOK.encode("def f(x):\n    return x + 1\n" * 80))
    ep = ruler_episode("niah_single", TOK.encode, 600, random.Random(2), "text", text)
    assert "return x + 1" in TOK.decode(ep.tokens.tolist())


class _Oracle(torch.nn.Module):
    """Predicts the next token of its input, except where ``wrong`` says (flat positions of row 0)."""

    def __init__(self, wrong: set[int] | None = None) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.wrong = wrong or set()

    def forward(self, x: torch.Tensor) -> SimpleNamespace:
        nxt = torch.roll(x, -1, 1)
        for t in self.wrong:
            nxt[:, t] = (nxt[:, t] + 1) % 256
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, 256).float())


def test_a_value_counts_only_when_every_token_is_right() -> None:
    ep = ruler_episode("niah_multivalue", TOK.encode, 512, random.Random(9))
    dev = torch.device("cpu")
    ((right, nll_right),) = grade_episodes(_Oracle(), [ep], dev, 1)
    assert right == 1.0
    a, b = ep.values[1]
    ((score, nll),) = grade_episodes(_Oracle({b - 2}), [ep], dev, 1)  # one wrong digit of the second value
    assert score == 0.75 and nll > nll_right
    n_tokens = sum(e - s for s, e in ep.values)  # the answer NLL: the wrong digit's share of the values' tokens
    one = math.log(math.e + 255)  # the oracle's one-hot logits: -log p of the right token is log(e + 255) - 1
    assert math.isclose(nll_right, one - 1, rel_tol=1e-6) and math.isclose(nll, one - 1 + 1 / n_tokens, rel_tol=1e-6)
    ((score, nll),) = grade_episodes(_Oracle({a - 3}), [ep], dev, 1)  # a wrong separator does not count
    assert score == 1.0 and math.isclose(nll, nll_right, rel_tol=1e-9)


def test_too_short_contexts_name_the_task() -> None:
    with pytest.raises(ConfigError, match="too short for the ruler task niah_multiquery"):
        ruler_episode("niah_multiquery", TOK.encode, 300, random.Random(0))


@pytest.fixture(scope="module")
def run_with_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nsa.train.trainer import Trainer
    from tests.conftest import quiet, resolve

    run = tmp_path_factory.mktemp("ruler") / "run"
    assert Trainer(resolve(run, 2, checkpoint__export_hf=True, eval__every=0), reporter=quiet()).fit().status == "completed"
    return run


def test_cli_scores_a_run_and_its_hf_export_alike(run_with_hf: Path, tmp_path: Path) -> None:
    args = ["--task", "ruler", "--contexts", "512,600", "--samples", "2", "--ruler-tasks", "niah_single,vt", "--json"]
    res = runner.invoke(app, ["eval", str(run_with_hf), *args])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    rows = payload["results"]
    assert [(r["task"], r["context"]) for r in rows] == [("niah_single", 512), ("vt", 512), ("niah_single", 600),
                                                          ("vt", 600), ("mean", 512), ("mean", 600)]
    assert all(0.0 <= r["score"] <= 1.0 and r["answer_nll"] > 0.0 for r in rows)
    assert payload["settings"]["haystack"] == "noise" and payload["settings"]["tasks"] == ["niah_single", "vt"]
    assert json.loads((run_with_hf / "eval" / "ruler.json").read_text())["results"] == rows
    assert "RULER-style suite" in res.stderr and "niah_single" in res.stderr and "answer nll" in res.stderr
    res = runner.invoke(app, ["eval", str(run_with_hf / "hf"), *args, "--no-save"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["results"] == rows  # the export is the same model
    res = runner.invoke(app, ["report", str(run_with_hf), "--out", str(tmp_path / "reports"), "--json"])
    assert res.exit_code == 0, res.output
    section = Path(json.loads(res.stdout)["path"]).read_text().split("#### RULER-style suite", 1)[1]
    assert "| task / context | 512 | 600 |" in section and "\n| mean | " in section


@pytest.mark.parametrize(("args", "needle"), [
    (["--ruler-tasks", "niah_single,qa"], "unknown ruler task(s) qa"),
    (["--contexts", "300", "--ruler-tasks", "niah_multiquery"], "too short for the ruler task niah_multiquery"),
    (["--contexts", "100"], "too short for the ruler task"),
])
def test_bad_ruler_input_is_one_line(run_with_hf: Path, args: list[str], needle: str) -> None:
    res = runner.invoke(app, ["eval", str(run_with_hf), "--task", "ruler", "--samples", "1", "--no-save", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("[")]
    assert len(lines) == 1 and needle in lines[0], res.stderr
