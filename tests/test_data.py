"""nsa.data: tokenizers, sources, bad records, packing, split/shard, loader position and stats."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
import threading
from itertools import islice

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nsa.data import DataConfig, build_loader, get_tokenizer, open_source_probe
from nsa.data.corpus import load_corpus
from nsa.data.corpus.harvest import harvest_documents, write_corpus
from nsa.data.packing import pack_sequences
from nsa.data.records import clean_text
from nsa.data.retrieval import TaskLayout
from nsa.data.sources import EmbeddedSource, SyntheticSource, check_local_inputs, first_record_within
from nsa.data.split import belongs, is_val
from nsa.errors import DataError


def _random_text(rng: random.Random, n: int) -> str:
    pool = "abcdefghij XYZ\n\t.,;é€漢字🙂\x00"
    return "".join(rng.choice(pool) for _ in range(n))


@pytest.fixture
def rng() -> random.Random:
    return random.Random(random.randrange(1 << 30))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Hugging Face network access, even when datasets/huggingface_hub are already imported."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# tokenizers ------------------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip(rng: random.Random) -> None:
    tok = get_tokenizer("byte")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("byte", 256, 0)
    for _ in range(20):
        text = _random_text(rng, rng.randrange(1, 200))
        ids = tok.encode(text)
        assert all(0 < i < 256 for i in ids)
        assert tok.decode(ids) == text.replace("\x00", "")


def test_gpt2_offline_is_a_clear_data_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(DataError, match="gpt2 tokenizer files are not cached") as info:
        get_tokenizer("gpt2")
    assert info.value.hint and "tokenizer_path" in info.value.hint
    with pytest.raises(DataError, match=r"no tokenizer\.json"):
        get_tokenizer("gpt2", str(tmp_path))


# records, packing, split -----------------------------------------------------------------------------
def test_clean_text_reasons() -> None:
    assert clean_text("fine", 10) == ("fine", None)
    assert clean_text(b"bytes ok", 10) == ("bytes ok", None)
    assert clean_text("   \n", 10) == (None, "empty")
    assert clean_text(None, 10) == (None, "missing_field")
    assert clean_text(17, 10) == (None, "not_str")
    assert clean_text(b"\xff\xfe", 10) == (None, "invalid_utf8")
    assert clean_text("lone \ud800", 10) == (None, "invalid_utf8")
    assert clean_text("x" * 11, 10) == (None, "too_long")


def test_pack_sequences_inserts_separators(rng: random.Random) -> None:
    docs = [[rng.randrange(1, 256) for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    seqs = list(pack_sequences(docs, seq_len=15, eot_id=0))
    stream = [t for d in docs for t in [*d, 0]]
    assert len(seqs) == len(stream) // 16
    assert np.concatenate(seqs).tolist() == stream[: 16 * len(seqs)]


def test_split_is_disjoint_and_ranks_partition() -> None:
    idx = range(5000)
    val = {i for i in idx if is_val(i, 0.1)}
    assert 300 < len(val) < 700
    for world in (1, 3):
        owners: dict[int, list[tuple[int, str]]] = {}
        for rank in range(world):
            for split in ("train", "val"):
                for i in idx:
                    if belongs(i, split=split, val_fraction=0.1, rank=rank, world_size=world):
                        owners.setdefault(i, []).append((rank, split))
        assert all(len(v) == 1 for v in owners.values()) and len(owners) == len(idx)
        assert {i for i, v in owners.items() if v[0][1] == "val"} == val


# sources and loaders ---------------------------------------------------------------------------------
def _batches(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def _same(a, b) -> bool:
    return all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True))


@pytest.mark.parametrize("split", ["train", "val"])
def test_embedded_loader_packs_its_split_shard(split: str) -> None:
    cfg = DataConfig(source="embedded", val_fraction=0.1, prefetch_depth=2)
    tok = get_tokenizer("byte")
    docs = [
        tok.encode(d)
        for i, d in enumerate(load_corpus())
        if belongs(i, split=split, val_fraction=0.1, rank=1, world_size=2)
    ]
    expected = list(islice(pack_sequences(docs, 64, 0), 12))
    with build_loader(
        cfg, tok, seq_len=64, batch_size=3, seed=0, rank=1, world_size=2, split=split
    ) as loader:
        got = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in _batches(loader, 4)])
        stats = loader.stats()
    assert got.dtype == torch.long and got.shape == (12, 65)
    assert got.tolist() == [s.tolist() for s in expected]
    assert stats["tokens_seen"] == 4 * 3 * 64 and stats["docs_seen"] > 0
    assert stats["fetch_p50_ms"] is not None and stats["fetch_p95_ms"] >= stats["fetch_p50_ms"]


def test_embedded_corpus_is_english_text() -> None:
    docs = load_corpus()
    assert len(docs) > 1000 and sum(map(len, docs)) < 3_000_000
    assert EmbeddedSource().describe().startswith("embedded:")


def _round_trip(cfg: DataConfig, seq_len: int, before: int, after: int) -> None:
    tok = get_tokenizer("byte")
    kw = {"seq_len": seq_len, "batch_size": 2, "seed": 3}
    with build_loader(cfg, tok, **kw) as loader:
        _batches(loader, before)
        state = json.loads(json.dumps(loader.state_dict()))  # must survive a checkpoint
        expected = _batches(loader, after)
    with build_loader(cfg, tok, **kw) as restored:
        restored.load_state_dict(state)
        assert restored.stats()["docs_seen"] == state["docs_seen"]
        assert _same(_batches(restored, after), expected)
        assert restored.state_dict()["batches"] == before + after


@pytest.mark.parametrize("source", ["embedded", "synthetic"])
def test_state_round_trip_exact(source: str, rng: random.Random) -> None:
    cfg = DataConfig(source=source, prefetch_depth=3)
    _round_trip(cfg, seq_len=rng.choice([8, 33, 100]), before=rng.randrange(1, 9), after=5)


def test_synthetic_assoc_recall_is_long_range_and_seeded() -> None:
    src = SyntheticSource("assoc_recall", seed=5, seq_len=64, vocab_size=256, eot_id=0)
    ep = src.episode(11)
    assert len(ep) == 64 and 0 not in ep.tolist()
    assert np.array_equal(ep, SyntheticSource("assoc_recall", 5, 64, 256, 0).episode(11))
    assert not np.array_equal(ep, SyntheticSource("assoc_recall", 6, 64, 256, 0).episode(11))
    n = src.n_pairs
    assert n == 4 and len(set(ep[0 : 2 * n : 2].tolist())) == n  # distinct keys
    assert set(ep[2 * n : src.query_start].tolist()) == {src.gap}
    # through the loader: y[:, t] at masked t is the value bound to the key x[:, t], far back
    cfg = DataConfig(source="synthetic", prefetch_depth=0)
    with build_loader(cfg, get_tokenizer("byte"), seq_len=64, batch_size=4, seed=5) as loader:
        x, y = next(loader)
    mask = torch.tensor(src.target_mask())
    assert int(mask.sum()) == n
    assert torch.all(y[:, -1] == 0)  # one episode per sequence, then the separator
    for row in range(4):
        pairs = x[row, : 2 * n].tolist()
        bound = dict(zip(pairs[0::2], pairs[1::2], strict=True))
        queried = x[row, mask].tolist()
        assert sorted(queried) == sorted(bound)  # every key asked once
        assert [bound[k] for k in queried] == y[row, mask].tolist()
        for t in mask.nonzero().flatten().tolist():
            assert pairs.index(int(x[row, t])) <= t - (64 - 4 * n)  # the pair is beyond the gap
    rand = SyntheticSource("random", 5, 64, 256, 0).episode(0)
    assert len(rand) == 64 and 0 not in rand.tolist()


def test_synthetic_needle_covers_the_edges() -> None:
    """Seed 3: a quarter of the needles sit first or right before the question, the rest spread over the
    sequence; with needle_edges=0 the depth is uniform and an edge almost never comes up."""
    layout = TaskLayout.for_vocab(256, 0)

    def depths(edges: float) -> list[int]:
        src = SyntheticSource("needle", seed=3, seq_len=256, vocab_size=256, eot_id=0, needle_edges=edges)
        out = []
        for i in range(400):
            ep = src.episode(i)
            keys = [t for t in range(256 - 2) if ep[t] in layout.keys and ep[t + 1] in layout.values]
            assert ep[-2] == ep[keys[0]] and ep[-1] == ep[keys[0] + 1]  # the needle is asked at the end
            out.append(keys[0])
        return out

    edged, uniform = depths(0.25), depths(0.0)
    at_edge = sum(p in (0, 256 - 4) for p in edged)
    assert 70 <= at_edge <= 130 and sum(p == 0 for p in edged) >= 30  # ~100 of 400, both ends
    assert sum(p in (0, 256 - 4) for p in uniform) <= 6
    assert len({p for p in edged if 0 < p < 252}) > 100  # the rest still spread
    assert DataConfig().needle_edges == 0.25


@pytest.fixture
def bad_jsonl(tmp_path, rng: random.Random):
    good = [_random_text(rng, rng.randrange(5, 50)).replace("\x00", "") + "." for _ in range(40)]
    rows = [{"text": t} for t in good]
    rows[3] = {"text": ""}
    rows[7] = {"text": 12345}
    rows[11] = {"text": "y" * 500}
    rows[15] = {"title": "no text field here"}
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_local_jsonl_counts_bad_records(bad_jsonl, offline) -> None:
    cfg = DataConfig(
        source="local", path=str(bad_jsonl), val_fraction=0.0, max_doc_chars=100, prefetch_depth=0
    )
    with build_loader(cfg, get_tokenizer("byte"), seq_len=32, batch_size=2, seed=0) as loader:
        _batches(loader, 30)  # more than one pass over the file
        stats = loader.stats()
    assert stats["epoch"] >= 1
    per_pass = {"empty": 1, "not_str": 1, "too_long": 1, "missing_field": 1}
    assert set(stats["skipped"]) == set(per_pass)
    assert all(stats["skipped"][k] % per_pass[k] == 0 and stats["skipped"][k] >= 1 for k in per_pass)


def test_local_parquet_and_txt_invalid_utf8(tmp_path, offline) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(
        pa.table({"body": pa.array([b"good bytes " * 3, b"\xff\xfe bad", b"more good text"])}),
        folder / "a.parquet",
    )
    cfg = DataConfig(source="local", path=str(folder), text_field="body", val_fraction=0.0, prefetch_depth=0)
    with build_loader(cfg, get_tokenizer("byte"), seq_len=8, batch_size=1, seed=0) as loader:
        _batches(loader, 6)
        assert loader.stats()["skipped"] == {"invalid_utf8": 1}
    txt = tmp_path / "notes.txt"
    txt.write_bytes(b"first paragraph here\n\nbroken \xff byte\n\nthird paragraph\n")
    cfg = DataConfig(source="local", path=str(txt), val_fraction=0.0, prefetch_depth=0)
    with build_loader(cfg, get_tokenizer("byte"), seq_len=8, batch_size=1, seed=0) as loader:
        ids = [t for x, y in _batches(loader, 4) for t in [*x[0].tolist(), y[0, -1].item()]]
        text = get_tokenizer("byte").decode(ids)
        assert text.startswith("first paragraph here") and "third paragraph" in text and "broken" not in text
        assert loader.stats()["skipped"] == {"invalid_utf8": 1}


def test_local_text_unit_file_keeps_whole_files_as_documents(tmp_path, offline) -> None:
    rng = random.Random(23)
    folder = tmp_path / "books"
    folder.mkdir()
    files = []
    for i in range(3):
        paras = ["".join(rng.choice("abcdefgh xyz") for _ in range(rng.randint(5, 40))).strip() or "p" for _ in range(4)]
        (folder / f"{i}.txt").write_text("\n\n".join(paras) + "\n")
        files.append(paras)
    tok = get_tokenizer("byte")

    def documents(unit: str) -> list[str]:
        cfg = DataConfig(source="local", path=str(folder), text_unit=unit, val_fraction=0.0, prefetch_depth=0)
        with build_loader(cfg, tok, seq_len=4096, batch_size=1, seed=0) as loader:
            x, y = next(loader)
        ids = [*x[0].tolist(), y[0, -1].item()]
        cut = [i for i, t in enumerate(ids) if t == tok.eot_id]
        return [tok.decode(ids[a + 1:b]) for a, b in zip([-1, *cut], cut, strict=False)]

    by_paragraph, by_file = documents("paragraph"), documents("file")
    assert [d.strip() for d in by_paragraph[:12]] == [p for paras in files for p in paras]
    assert [d.strip() for d in by_file[:3]] == ["\n\n".join(paras) for paras in files]
    wrong = DataConfig(source="local", path=str(_jsonl(tmp_path)), text_unit="file")
    with pytest.raises(DataError, match=r"text_unit=file applies to \.txt"):
        build_loader(wrong, tok, seq_len=8, batch_size=1, seed=0)
    with pytest.raises(DataError, match=r"text_unit=file applies to \.txt"):  # preflight's check, before any training
        check_local_inputs(wrong)


def _jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    return path


def test_local_state_round_trip_exact(bad_jsonl, offline) -> None:
    cfg = DataConfig(
        source="local", path=str(bad_jsonl), val_fraction=0.2, max_doc_chars=100, prefetch_depth=2
    )
    _round_trip(cfg, seq_len=11, before=5, after=6)


def test_local_path_errors(tmp_path, bad_jsonl, offline) -> None:
    tok = get_tokenizer("byte")
    with pytest.raises(DataError, match="does not exist"):
        build_loader(
            DataConfig(source="local", path=str(tmp_path / "nope")), tok, seq_len=8, batch_size=1, seed=0
        )
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.md").write_text("not data")
    with pytest.raises(DataError, match=r"no \.jsonl"):
        build_loader(
            DataConfig(source="local", path=str(tmp_path / "empty")), tok, seq_len=8, batch_size=1, seed=0
        )
    with pytest.raises(DataError, match="'content' is not a field"):
        open_source_probe(DataConfig(source="local", path=str(bad_jsonl), text_field="content"), 5)
    assert open_source_probe(DataConfig(source="local", path=str(bad_jsonl)), 5).startswith("local:")


def test_val_split_empty_is_an_error() -> None:
    with pytest.raises(DataError, match="val split is empty"):
        build_loader(
            DataConfig(val_fraction=0.0), get_tokenizer("byte"), seq_len=8, batch_size=1, seed=0, split="val"
        )


# Hugging Face streaming ------------------------------------------------------------------------------
def test_hf_stream_offline_error_and_fallback(offline) -> None:
    cfg = DataConfig(source="fineweb_edu", hf_dataset="nsa-test/not-a-dataset", timeout_s=30)
    with pytest.raises(DataError, match="unreachable") as info:
        build_loader(cfg, get_tokenizer("byte"), seq_len=16, batch_size=2, seed=0)
    assert "synthetic_on_fail" in (info.value.hint or "")
    with pytest.raises(DataError):
        open_source_probe(cfg, 30)
    fallback = cfg.model_copy(update={"synthetic_on_fail": True})
    with build_loader(fallback, get_tokenizer("byte"), seq_len=16, batch_size=2, seed=0) as loader:
        x, y = next(loader)
        assert x.shape == y.shape == (2, 16) and "SYNTHETIC" in loader.stats()["warnings"][0]


def test_first_fetch_timeout_gives_up() -> None:
    release = threading.Event()
    try:
        with pytest.raises(DataError, match="no data within"):
            first_record_within(release.wait, 0.2, "slow source")
    finally:
        release.set()


# packaging -------------------------------------------------------------------------------------------
def test_importing_data_config_does_not_import_torch() -> None:
    code = "import sys, nsa.config, nsa.data, nsa.config.data; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_corpus_harvest_writes_documents(tmp_path, rng: random.Random) -> None:
    words = ["alpha", "beta", "gamma", "delta"]
    doc = " ".join(rng.choice(words) for _ in range(30))
    (tmp_path / "mod.py").write_text(
        f'"""{doc}"""\n\ndef f():\n    """{doc} again."""\n\ndef g():\n    """short"""\n'
    )
    docs = harvest_documents(tmp_path, min_chars=50)
    assert [d["name"] for d in docs] == ["mod", "mod.f"]
    out = tmp_path / "corpus.jsonl.gz"
    assert write_corpus(docs, out, max_chars=10_000) == 2
    with gzip.open(out, "rt", encoding="utf-8") as fh:
        assert sorted(json.loads(line)["text"] for line in fh) == sorted(d["text"] for d in docs)


def test_byte_tokenizer_array_equals_its_list() -> None:
    """``ByteTokenizer.encode_array`` (what the loader packs from) gives ``encode``'s ids as int64, NUL removed,
    on random text of ASCII, multi-byte characters and NULs (seed 7)."""
    rng = random.Random(7)
    tok = get_tokenizer("byte")
    alphabet = "ab \n\x00é中🙂\t"
    for n in (0, 1, 17, 1000):
        text = "".join(rng.choice(alphabet) for _ in range(n))
        arr = tok.encode_array(text)  # type: ignore[attr-defined]
        assert arr.dtype == np.int64 and arr.tolist() == tok.encode(text)
