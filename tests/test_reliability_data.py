"""Local data faults: malformed JSONL lines are skipped and counted; empty or missing inputs fail fast."""

from __future__ import annotations

import gzip
import json
import random
import time
from pathlib import Path

import pytest

from nsa.data import DataConfig, build_loader, check_local_inputs, get_tokenizer
from nsa.data import sources as sources_mod
from nsa.data.records import Malformed
from nsa.data.sources import LocalSource
from nsa.errors import DataError

SEED = 1234


def _docs(n: int, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "é", "漢字", "🙂", '"quoted"', "back\\slash"]
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 12))) + "." for _ in range(n)]


def _local(path: Path, **kw: object) -> DataConfig:
    return DataConfig(source="local", path=str(path), val_fraction=0.0, prefetch_depth=0, **kw)


def _data_error(cfg: DataConfig) -> DataError:
    with pytest.raises(DataError) as info:
        check_local_inputs(cfg)
    err = info.value
    assert "\n" not in err.one_line() and err.hint
    return err


def _with_bad_lines(path: Path, docs: list[str], bad: dict[int, str]) -> list[str]:
    """Write ``docs`` as JSONL with the raw lines ``bad`` at those 1-based line numbers; the good texts."""
    lines, good = [], iter(docs)
    for n in range(1, len(docs) + len(bad) + 1):
        lines.append(bad[n] if n in bad else json.dumps({"text": next(good), "id": n}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return docs


def test_malformed_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    bad = {4: '{"text": "unterminated', 9: "not json at all", 15: "[1, 2, 3]"}
    good = _with_bad_lines(path, _docs(30), bad)
    source = LocalSource(str(path), "text")
    records = list(source.documents(0))
    assert [i + 1 for i, r in enumerate(records) if isinstance(r, Malformed)] == [4, 9, 15]
    assert [r for r in records if not isinstance(r, Malformed)] == good  # same order, same field
    cfg = _local(path)
    with build_loader(cfg, get_tokenizer("byte"), seq_len=32, batch_size=2, seed=SEED) as loader:
        for _ in range(40):  # more than one pass over the file
            next(loader)
        stats = loader.stats()
    assert stats["epoch"] >= 1
    assert 3 * stats["epoch"] <= stats["skipped"]["malformed"] <= 3 * (stats["epoch"] + 1)  # 3 per pass
    (warning,) = stats["warnings"]
    assert "3 malformed JSON line(s)" in warning and f"{path} line 4:" in warning


def test_malformed_line_warning_names_file_and_line_in_a_folder(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(5)))
    _with_bad_lines(tmp_path / "b.jsonl", _docs(5, SEED + 1), {2: "{oops}"})
    check_local_inputs(_local(tmp_path))
    (warning,) = LocalSource(str(tmp_path), "text").warnings()
    assert "1 malformed JSON line(s)" in warning and f"{tmp_path / 'b.jsonl'} line 2:" in warning


def test_malformed_count_of_a_big_input_follows_the_first_pass(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sources_mod, "EAGER_SCAN_BYTES", 0)  # as for inputs too big to scan at open
    path = tmp_path / "big.jsonl"
    _with_bad_lines(path, _docs(10), {3: "}", 7: "{]"})
    source = LocalSource(str(path), "text")
    assert source.warnings() == []
    it = source.documents(0)
    for _ in range(3):
        next(it)
    (interim,) = source.warnings()
    assert "the count follows" in interim and f"{path} line 3:" in interim
    list(it)
    (final,) = source.warnings()
    assert "2 malformed JSON line(s)" in final and f"{path} line 3:" in final


def test_empty_jsonl_is_one_clear_data_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    err = _data_error(_local(path))
    assert str(path) in err.message and "empty" in err.message
    with pytest.raises(DataError, match="empty"):
        build_loader(_local(path), get_tokenizer("byte"), seq_len=8, batch_size=1, seed=SEED)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\n")
    assert "no records" in _data_error(_local(blank)).message


def test_only_malformed_lines_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "no end\n\nplain text\n{"text": 1,}\n', encoding="utf-8")
    err = _data_error(_local(path))
    assert "no valid JSON record" in err.message and "3 malformed line(s)" in err.message
    assert f"{path} line 1:" in err.message
    with pytest.raises(DataError, match="no valid JSON record"):
        build_loader(_local(path), get_tokenizer("byte"), seq_len=8, batch_size=1, seed=SEED)


def test_missing_path_is_a_fast_data_error(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such.jsonl"
    t0 = time.perf_counter()
    err = _data_error(_local(missing))
    assert time.perf_counter() - t0 < 2.0
    assert str(missing) in err.message and "does not exist" in err.message
    assert err.hint and "data-path" in err.hint


def test_folder_without_usable_files_is_a_data_error(tmp_path: Path) -> None:
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "README.md").write_text("not data")
    assert "no .jsonl" in _data_error(_local(nothing)).message
    zeros = tmp_path / "zeros"
    zeros.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (zeros / name).write_bytes(b"")
    assert "only empty files (2 of 0 bytes)" in _data_error(_local(zeros)).message
    txt = tmp_path / "txt"
    txt.mkdir()
    (txt / "a.txt").write_text("\n\n   \n")
    assert "no records" in _data_error(_local(txt)).message


def test_valid_inputs_read_as_before(tmp_path: Path) -> None:
    docs = _docs(25)
    rows = [{"id": i, "text": d, "meta": {"n": i}} for i, d in enumerate(docs)]
    body = "".join(json.dumps(r) + "\n" for r in rows)
    variants = {
        "plain.jsonl": body.encode(),
        "crlf_blank_bom.jsonl": b"\xef\xbb\xbf\n" + body.replace("\n", "\r\n\r\n").encode(),
        "array.json": json.dumps(rows, indent=1).encode(),
    }
    for name, data in variants.items():
        (tmp_path / name).write_bytes(data)
    with gzip.open(tmp_path / "packed.jsonl.gz", "wb") as fh:
        fh.write(body.rstrip("\n").encode())  # no final newline
    for name in [*variants, "packed.jsonl.gz"]:
        cfg = _local(tmp_path / name)
        check_local_inputs(cfg)
        source = LocalSource(str(tmp_path / name), "text")
        assert list(source.documents(0)) == docs, name
        assert list(source.documents(7)) == docs[7:], name
        assert source.warnings() == []
    (tmp_path / "strings.json").write_text(json.dumps(docs[:3]))
    assert list(LocalSource(str(tmp_path / "strings.json"), "text").documents(0)) == docs[:3]
    check_local_inputs(DataConfig(source="embedded"))  # other sources: nothing to check


def test_the_trainer_refuses_missing_local_data_before_making_the_run_directory(tmp_path: Path) -> None:
    """`nsa train --data-path` of a path that is not there: one line at once, no run-directory stub."""
    from typer.testing import CliRunner

    from nsa_cli.app import app

    run = tmp_path / "run"
    t0 = time.perf_counter()
    res = CliRunner().invoke(app, ["train", "--config", "tiny", "--steps", "3", "--out-dir", str(run),
                                   "--set", "data.source=local", "--data-path", str(tmp_path / "missing.jsonl")], env={})
    assert res.exit_code == 2 and "does not exist" in res.output and len(res.output.strip().splitlines()) == 1
    assert time.perf_counter() - t0 < 5 and not run.exists()
