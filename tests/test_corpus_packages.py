"""nsa.data.corpus.packages: a corpus built from the files of installed distributions (a fake site-packages)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from nsa.data.corpus.packages import build_corpus, iter_package_files, main
from nsa.data.sources import LocalSource
from nsa.data.split import is_val
from nsa.errors import DataError

SEED = 0
OTHER_SEED = 1
LICENSE = "\n".join(f"Licence clause {i}: permission is granted, without warranty." for i in range(20)) + "\n"


def _text(label: str, lines: int = 30) -> str:
    """A distinct, kept-size (> 512 bytes) text."""
    return f"# {label}\n" + "\n".join(f"line {i} of {label}: some ordinary source text" for i in range(lines)) + "\n"


def _dist(site: Path, name: str, version: str, files: dict[str, bytes], record: bool = True) -> None:
    """A distribution in ``site``: its files and ``<name>-<version>.dist-info`` (METADATA, RECORD listing them)."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for rel, data in files.items():
        if data:
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_bytes(data)
    if record:
        rows = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
        (info / "RECORD").write_text("".join(f"{r},,\n" for r in rows))


# what each fake distribution ships, and which of it is kept (package, path)
KEPT = {
    ("alpha", "alpha/LICENSE.txt"): LICENSE,
    ("alpha", "alpha/README.md"): "# Alpha\n\n" + _text("alpha readme"),
    ("alpha", "alpha/__init__.py"): _text("alpha init"),
    ("alpha", "alpha/core.py"): "# é€漢字🙂\n" + _text("alpha core"),
    ("beta-pkg", "beta/UPPER.PY"): _text("beta upper-case suffix"),
    ("beta-pkg", "beta/kernel.cu"): _text("beta kernel", 50),
    ("beta-pkg", "beta/mod.pyi"): _text("beta stub", 40),
}


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site-packages"
    _dist(site, "alpha", "1.0", {
        "alpha/__init__.py": KEPT["alpha", "alpha/__init__.py"].encode(),
        "alpha/core.py": KEPT["alpha", "alpha/core.py"].encode(),
        "alpha/README.md": KEPT["alpha", "alpha/README.md"].encode(),
        "alpha/LICENSE.txt": LICENSE.encode(),
        "alpha/tiny.py": b"x = 1\n",  # below min_bytes
        "alpha/blob.txt": b"\xff\xfe\x00\x80" * 300,  # not UTF-8
        "alpha/nul.py": (_text("nul") + "\x00").encode(),  # a NUL character
        "alpha/table.py": (_text("table") + "T = [" + "1, " * 1665 + "]\n").encode(),  # a 5000-char line
        "alpha/data.json": _text("json, a suffix not listed").encode(),
        "alpha/missing.py": b"",  # in RECORD, not on disk
    })
    _dist(site, "beta_pkg", "2.0", {
        "beta/LICENSE.txt": LICENSE.encode(),  # the same text as alpha's: a duplicate
        "beta/mod.pyi": KEPT["beta-pkg", "beta/mod.pyi"].encode(),
        "beta/kernel.cu": KEPT["beta-pkg", "beta/kernel.cu"].encode(),
        "beta/UPPER.PY": KEPT["beta-pkg", "beta/UPPER.PY"].encode(),
    })
    _dist(site, "gamma", "0.1", {"gamma/skipped.py": _text("gamma").encode()}, record=False)  # files is None
    return site


def _read_shards(out: Path) -> list[dict[str, str]]:
    lines = []
    for shard in sorted((out / "text").iterdir()):
        lines += [json.loads(line) for line in shard.read_text(encoding="utf-8").split("\n") if line]
    return lines


def _build(site: Path, out: Path, **kwargs: Any) -> dict[str, Any]:
    """``build_corpus`` of ``site`` into ``out``: no minimum, shards of ~2 kB, seed ``SEED`` unless given."""
    kwargs = {"min_total_bytes": 1, "shard_bytes": 2000, "seed": SEED, **kwargs}
    return build_corpus(out, paths=[str(site)], **kwargs)


def test_iter_package_files_keeps_text_and_drops_the_rest(site: Path) -> None:
    files = list(iter_package_files([str(site)]))
    got = [(f.package, f.version, f.path) for f in files]
    assert got == [
        ("alpha", "1.0", "alpha/LICENSE.txt"),
        ("alpha", "1.0", "alpha/README.md"),
        ("alpha", "1.0", "alpha/__init__.py"),
        ("alpha", "1.0", "alpha/core.py"),
        ("beta_pkg", "2.0", "beta/LICENSE.txt"),  # dropped later, as a duplicate
        ("beta_pkg", "2.0", "beta/UPPER.PY"),
        ("beta_pkg", "2.0", "beta/kernel.cu"),
        ("beta_pkg", "2.0", "beta/mod.pyi"),
    ]
    assert files[3].text == KEPT["alpha", "alpha/core.py"]
    assert [f.path for f in iter_package_files([str(site)], suffixes=(".json",))] == ["alpha/data.json"]
    assert "alpha/tiny.py" in [f.path for f in iter_package_files([str(site)], min_bytes=1)]


def test_a_name_seen_twice_is_taken_once(site: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-site"
    _dist(other, "Alpha", "1.0", {"alpha/extra.py": _text("the second alpha").encode()})
    paths = [f.path for f in iter_package_files([str(site), str(other)]) if f.package.lower() == "alpha"]
    assert paths == ["alpha/LICENSE.txt", "alpha/README.md", "alpha/__init__.py", "alpha/core.py"]


def test_build_corpus_writes_the_kept_texts_shuffled(site: Path, tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    manifest = _build(site, out, val_fraction=0.3)
    assert json.loads((out / "manifest.json").read_text(encoding="utf-8")) == manifest
    kept = {(p if p != "beta-pkg" else "beta_pkg", path): t for (p, path), t in KEPT.items()}
    records = _read_shards(out)
    texts = [r["text"] for r in records]
    assert sorted(texts) == sorted(kept.values())  # each kept text exactly once
    assert texts != [kept[k] for k in sorted(kept)]  # shuffled (seed 0 moves these 7)
    for r in records:
        package, rest = r["source"].split("==", 1)
        version, path = rest.split(":", 1)
        assert kept[package, path] == r["text"] and version == {"alpha": "1.0", "beta_pkg": "2.0"}[package]
    assert len(list((out / "text").iterdir())) == len(manifest["shards"]) > 1
    assert manifest["files"] == 7 and manifest["duplicates_dropped"] == 1
    assert manifest["bytes"] == sum(len(t.encode("utf-8")) for t in texts)
    assert sum(p["files"] for p in manifest["packages"]) == manifest["files"]
    assert sum(p["bytes"] for p in manifest["packages"]) == manifest["bytes"]
    assert [p["bytes"] for p in manifest["packages"]] == sorted((p["bytes"] for p in manifest["packages"]), reverse=True)
    assert {(p["name"], p["version"], p["files"]) for p in manifest["packages"]} == {("alpha", "1.0", 4), ("beta_pkg", "2.0", 3)}
    held = [t for i, t in enumerate(texts) if is_val(i, 0.3)]
    assert 0 < len(held) < len(texts)
    assert manifest["held_out"] == {"files": len(held), "bytes": sum(len(t.encode("utf-8")) for t in held)}
    assert manifest["sha256"] == hashlib.sha256(b"".join(t.encode("utf-8") + b"\x00" for t in texts)).hexdigest()
    assert manifest["seed"] == SEED and manifest["val_fraction"] == 0.3 and manifest["data_path"] == "text"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_same_seed_same_corpus_other_seed_other_order(site: Path, tmp_path: Path) -> None:
    first = _build(site, tmp_path / "a")
    again = _build(site, tmp_path / "b")
    other = _build(site, tmp_path / "c", seed=OTHER_SEED)
    assert again["sha256"] == first["sha256"]
    assert _read_shards(tmp_path / "a") == _read_shards(tmp_path / "b")
    assert other["sha256"] != first["sha256"]
    a, c = ([r["text"] for r in _read_shards(tmp_path / x)] for x in "ac")
    assert a != c and sorted(a) == sorted(c)


def test_max_total_bytes_stops_before_the_document_that_would_pass_it(site: Path, tmp_path: Path) -> None:
    _build(site, tmp_path / "full")
    full = [r["text"] for r in _read_shards(tmp_path / "full")]
    limit = sum(len(t.encode("utf-8")) for t in full[:3]) + 1
    manifest = _build(site, tmp_path / "cut", max_total_bytes=limit)
    assert [r["text"] for r in _read_shards(tmp_path / "cut")] == full[:3]
    assert manifest["files"] == 3 and manifest["bytes"] == limit - 1


def test_too_small_a_corpus_raises_and_writes_nothing(site: Path, tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    with pytest.raises(DataError) as info:
        _build(site, out, min_total_bytes=10**9)
    assert "below the minimum of 1,000,000,000 bytes" in info.value.message and "\n" not in info.value.message
    assert info.value.hint
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site-packages"]


def test_a_non_empty_out_is_refused_an_empty_one_used(site: Path, tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not an empty folder"):
        _build(site, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _build(site, empty)["files"] == 7
    assert sorted(p.name for p in empty.iterdir()) == ["manifest.json", "text"]


def test_cli_too_small_exits_2_with_one_error_line(site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "corpus"
    with pytest.raises(SystemExit) as info:
        main([str(out), "--path", str(site), "--min-mb", "1000"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "hint:" in err
    assert not out.exists()


def test_cli_builds_and_summarises(site: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "corpus"
    main([str(out), "--path", str(site), "--min-mb", "0.001", "--seed", "3", "--val-fraction", "0.5"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" MB")[0].rsplit(",", 1)[0] for line in lines[:2]] == ["beta_pkg==2.0: 3 files", "alpha==1.0: 4 files"]
    assert "7 files" in lines[-1] and "1 duplicates dropped" in lines[-1]
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["seed"] == 3 and manifest["val_fraction"] == 0.5


def test_the_loader_reads_it_in_the_written_order(site: Path, tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    _build(site, out, shard_bytes=1)  # one document per shard: the shards must be read in name order
    texts = [r["text"] for r in _read_shards(out)]
    source = LocalSource(str(out / "text"), "text")
    assert list(source.documents(0)) == texts
    assert list(source.documents(5)) == texts[5:]
