"""Document sources: deterministic streams of raw records that can restart at any document index.

``Source.documents(start)`` yields the raw record of document ``start``, ``start + 1``, ... (text for
``embedded``/``local``/``fineweb_edu``, which the loader checks with :func:`nsa.data.records.clean_text`;
token id arrays for ``synthetic``). Finite sources end; the loader starts them again for the next epoch.
A source may also have ``warnings() -> list[str]`` (stable lines the loader adds to ``stats()["warnings"]``).

:func:`check_local_inputs` is the cheap up-front check of ``data.source=local`` inputs (missing path, no
files, empty files, no parseable record), meant to run before anything is created on disk.

Size: every data source (embedded, local files, synthetic tasks, streamed Hugging Face) behind one protocol.
"""

from __future__ import annotations

import gzip
import io
import json
import queue
import threading
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol, cast

import numpy as np

from nsa.config.data import DataConfig
from nsa.data.corpus import load_corpus
from nsa.data.records import Malformed
from nsa.data.retrieval import TaskLayout, mqar_episode, needle_episode
from nsa.errors import DataError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
OFFLINE_HINT = (
    "check the network (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE must be unset), use data.source=embedded or "
    "local, or set data.synthetic_on_fail=true"
)
PATH_HINT = (
    "fix --data-path / data.path: a .jsonl, .json, .parquet or .txt file (optionally .gz) or a folder of them"
)
EAGER_SCAN_BYTES = 64 << 20  # JSON inputs up to this size are read once at open to count malformed lines
WHOLE_FILE_BYTES = 64 << 20  # a .json file whose first line is not JSON is tried as one object up to this
EMPTY_HINT = "put records in it, or point --data-path / data.path at other data"
ENCODING_PROBE_BYTES = 1 << 20  # the start of each text/JSON file read to check it is UTF-8 text
FIELD_PROBE_RECORDS = 1000  # data.text_field must appear in one of the first this many records
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


class Source(Protocol):
    """A deterministic, restartable stream of documents."""

    name: str
    finite: bool  # True: ends, and the loader restarts it at index 0 for the next epoch
    tokenized: bool  # True: records are token id lists (synthetic), else text
    one_length: bool  # True: documents are laid out for one seq_len (synthetic episodes): a resume keeps it

    def documents(self, start: int) -> Iterator[Any]: ...

    def describe(self) -> str: ...


class EmbeddedSource:
    """The corpus shipped in ``nsa/data/corpus`` (standard-library docstrings)."""

    name = "embedded"
    finite = True
    tokenized = False
    one_length = False

    def __init__(self) -> None:
        self._docs = load_corpus()

    def documents(self, start: int) -> Iterator[Any]:
        return islice(self._docs, start, None)

    def describe(self) -> str:
        chars = sum(len(d) for d in self._docs)
        return (
            f"embedded: {len(self._docs)} documents, {chars / 1e6:.1f}M characters (Python stdlib docstrings)"
        )


def _format_of(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return FORMATS.get(suffixes[-1]) if suffixes else None


def _shown(path: str) -> str:
    """``path``, and what it resolves to when that differs (relative paths, ``~``)."""
    full = str(Path(path).expanduser().absolute())
    return path if full == path else f"{path} ({full})"


def resolve_local_files(path: str) -> tuple[str, list[str]]:
    """``(format, files)`` for a file or a folder of JSONL/JSON/Parquet/.txt files (optionally .gz)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"data.path={_shown(path)} does not exist", hint=PATH_HINT)
    if root.is_file():
        files = [root]
    else:
        files = sorted(
            p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".") and _format_of(p)
        )
    formats = {_format_of(p) for p in files}
    if not files or None in formats:
        raise DataError(
            f"data.path={_shown(path)}: no .jsonl, .json, .parquet or .txt files there",
            hint="use JSONL, Parquet or text files (optionally gzipped)",
        )
    if len(formats) > 1:
        raise DataError(
            f"data.path={path} mixes formats ({', '.join(sorted(str(f) for f in formats))})",
            hint="keep one format per folder",
        )
    return str(formats.pop()), [str(p.resolve()) for p in files]


def ignored_local_files(path: str) -> list[str]:
    """Files under a ``data.path`` folder that are not read: not .jsonl/.json/.parquet/.txt (optionally .gz);
    hidden files left out. Empty for a single file."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return []
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
                  and not _format_of(p))


def describe_files(files: list[str], ignored: list[str], shown: int = 3) -> str:
    """``"a.txt, b.txt, ... (12 files, 3.4 MB); ignored 35 files of other types (.py 33, .md 2)"``."""
    names = [Path(f).name for f in files]
    head = ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")
    size = sum(Path(f).stat().st_size for f in files)
    shown_size = f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"
    text = f"{head} ({len(files)} file(s), {shown_size} on disk)"
    if ignored:
        kinds: dict[str, int] = {}
        for f in ignored:
            kind = "".join(Path(f).suffixes[-1:]) or "no extension"
            kinds[kind] = kinds.get(kind, 0) + 1
        top = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))[:5])
        text += f"; ignored {len(ignored)} file(s) of other types ({top})"
    return text


# JSON / JSON Lines, read with the json module -------------------------------------------------------
def _open_binary(file: str) -> BinaryIO:
    if file.lower().endswith(".gz"):
        return cast(BinaryIO, gzip.open(file, "rb"))
    return open(file, "rb")


def _json_error(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} (column {exc.colno})"
    return _one_line(exc)


def _as_object(value: Any, file: str, line: int, what: str = "the line") -> Any:
    if isinstance(value, dict):
        return value
    kind = "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)
    return Malformed(file, line, f"{what} is {kind}, not a JSON object")


def _parse_line(raw: bytes, file: str, line: int) -> Any:
    """The JSON object on one line of a JSONL file, or :class:`Malformed`."""
    try:
        value = json.loads(raw.decode("utf-8", errors="replace"))  # bad bytes become U+FFFD: invalid_utf8
    except (ValueError, RecursionError) as exc:
        return Malformed(file, line, _json_error(exc))
    return _as_object(value, file, line)


def _json_whole(data: bytes, file: str, line: int) -> list[Any]:
    """Records of a whole-file JSON value: an array of objects (strings become ``{"text": s}``) or one
    object."""
    try:
        value = json.loads(data.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError) as exc:
        where = line + exc.lineno - 1 if isinstance(exc, json.JSONDecodeError) else line
        return [Malformed(file, where, _json_error(exc))]
    if not isinstance(value, list):
        return [_as_object(value, file, line, "the file")]
    return [
        {"text": v} if isinstance(v, str) else _as_object(v, file, line, f"array item {i}")
        for i, v in enumerate(value)
    ]


def _nonblank_lines(fh: IO[bytes], line: int) -> Iterator[tuple[int, bytes]]:
    """``(line, stripped)`` for each non-blank line of ``fh``, numbering on from ``line``."""
    for raw in fh:
        line += 1
        stripped = raw.strip()
        if stripped:
            yield line, stripped


def _json_rows(file: str) -> Iterator[tuple[int, Any]]:
    """``(line, item)`` for each record of one JSON file, in order.

    JSON Lines: one record per non-blank line, ``item`` the raw line (parse it with :func:`_json_record`,
    so skipping stays cheap). A file whose first non-blank line starts with ``[`` is one JSON array, and
    a small file whose first line is not JSON but which parses whole is one (pretty-printed) object;
    their items are already parsed.
    """
    try:
        with _open_binary(file) as fh:
            line, raw, stripped = 0, b"", b""
            for raw in fh:
                line += 1
                if line == 1:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")  # UTF-8 byte order mark
                stripped = raw.strip()
                if stripped:
                    break
            if not stripped:
                return  # empty, or only blank lines
            if stripped.startswith(b"["):
                yield from ((line, item) for item in _json_whole(raw + fh.read(), file, line))
                return
            rest: IO[bytes] = fh
            if isinstance(_parse_line(stripped, file, line), Malformed) and (
                Path(file).stat().st_size <= WHOLE_FILE_BYTES
            ):
                data = fh.read()
                whole = _json_whole(raw + data, file, line)
                if not isinstance(whole[0], Malformed):
                    yield from ((line, item) for item in whole)
                    return
                rest = io.BytesIO(data)  # JSON Lines with a bad first line
            yield line, stripped
            yield from _nonblank_lines(rest, line)
    except (OSError, EOFError) as exc:  # unreadable, or a broken .gz
        raise DataError(f"cannot read {file}: {_one_line(exc)}", hint="check or replace that file") from None


def _json_record(file: str, line: int, item: Any) -> Any:
    return _parse_line(item, file, line) if isinstance(item, bytes) else item


def _json_records(files: list[str], start: int = 0) -> Iterator[Any]:
    """Parsed records (dicts or :class:`Malformed`) of ``files`` from record ``start`` on."""
    index = 0
    for file in files:
        for line, item in _json_rows(file):
            if index >= start:
                yield _json_record(file, line, item)
            index += 1


# cheap checks of local inputs ---------------------------------------------------------------------------
def _unreadable(file: str, exc: BaseException) -> DataError:
    return DataError(f"cannot read {file}: {_one_line(exc)}", hint="check or replace that file")


def _has_record(fmt: str, files: list[str]) -> tuple[bool, int, Malformed | None]:
    """``(found, malformed, first malformed)``: reads from the start only up to the first usable record."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        for file in files:
            try:
                if pq.ParquetFile(file).metadata.num_rows > 0:
                    return True, 0, None
            except Exception as exc:
                raise _unreadable(file, exc) from None
    elif fmt == "text":
        for file in files:
            try:
                with _open_binary(file) as fh:
                    if any(raw.strip() for raw in fh):
                        return True, 0, None
            except (OSError, EOFError) as exc:
                raise _unreadable(file, exc) from None
    else:
        bad, first = 0, None
        for record in _json_records(files):
            if not isinstance(record, Malformed):
                return True, bad, first
            bad += 1
            first = first or record
        return False, bad, first
    return False, 0, None


def _check_local_path(path: str) -> tuple[str, list[str]]:
    """:func:`resolve_local_files`, plus DataError when the files hold no usable record."""
    fmt, files = resolve_local_files(path)
    nonempty = [f for f in files if Path(f).stat().st_size > 0]
    if not nonempty:
        single = len(files) == 1 and Path(path).expanduser().is_file()
        what = "is an empty file (0 bytes)" if single else f"holds only empty files ({len(files)} of 0 bytes)"
        raise DataError(f"data.path={_shown(path)} {what}", hint=EMPTY_HINT)
    _check_encoding(path, fmt, nonempty)
    found, bad, first = _has_record(fmt, nonempty)
    if found:
        return fmt, files
    if first is not None:
        raise DataError(
            f"data.path={path}: no valid JSON record, {bad} malformed line(s) (first: {first.where()})",
            hint='each line of a .jsonl file must be one JSON object, e.g. {"text": "..."}',
        )
    raise DataError(f"data.path={path} holds no records (only blank lines or no rows)", hint=EMPTY_HINT)


def _not_utf8(head: bytes, cut: bool, fmt: str) -> tuple[str, int, int] | None:
    """``(what is wrong, records that are not UTF-8, records read)`` of the start of a file (``cut``: it goes
    on beyond ``head``), or None when it reads as UTF-8 text. Records: paragraphs of a text file, lines of
    JSON."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "is UTF-16 text (a byte order mark), not UTF-8", 1, 1
    units = [u for u in (head.split(b"\n\n") if fmt == "text" else head.splitlines()) if u.strip()]
    if cut and len(units) > 1:
        units = units[:-1]  # the last one may be cut in the middle of a character
    bad = 0
    first: str | None = None
    for unit in units:
        try:
            unit.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad += 1
            if first is None:
                offset = head.find(unit) + exc.start
                line = head.count(b"\n", 0, offset) + 1
                first = f"byte 0x{unit[exc.start]:02x} at line {line}"
        if b"\x00" in unit:
            return "is a binary file (NUL bytes), not text", len(units), len(units)
    if not units or 2 * bad <= len(units):
        return None
    return f"is not UTF-8 text (first bad {first}; Latin-1 or another 8-bit encoding?)", bad, len(units)


def _check_encoding(path: str, fmt: str, files: list[str]) -> None:
    """``DataError`` naming the file when the start of a text or JSON file is mostly not UTF-8 (Latin-1,
    UTF-16, binary): the loader would skip its records as ``invalid_utf8`` and find too little to train on."""
    if fmt not in ("text", "json"):
        return
    unit = "paragraph" if fmt == "text" else "line"
    for file in files:
        try:
            with _open_binary(file) as fh:
                head = fh.read(ENCODING_PROBE_BYTES + 1)
        except (OSError, EOFError) as exc:
            raise _unreadable(file, exc) from None
        cut = len(head) > ENCODING_PROBE_BYTES
        found = _not_utf8(head[:ENCODING_PROBE_BYTES], cut, fmt)
        if found is not None:
            what, bad, seen = found
            where = "" if file == path else f" ({file})"
            raise DataError(
                f"data.path={path}{where}: {Path(file).name} {what}: {bad} of {seen} {unit}(s) read would be "
                f"skipped as invalid_utf8",
                hint=f"convert it to UTF-8, e.g. iconv -f latin1 -t utf-8 {file} > "
                     f"{Path(file).stem}.utf8{Path(file).suffix}",
            )


def check_local_inputs(data_cfg: DataConfig) -> None:
    """Fail fast, with a one-line :class:`DataError`, on unusable ``data.source=local`` inputs.

    Reads ``data_cfg.source`` and ``data_cfg.path`` only; a no-op for other sources. Checks that the path
    exists, holds files of one known format, not all of 0 bytes, and that a record parses (reading from
    the start only up to the first usable record, so big files cost little). Creates nothing.
    """
    if data_cfg.source != "local":
        return
    if not data_cfg.path:
        raise DataError("data.path is required when data.source=local", hint=PATH_HINT)
    fmt, _ = _check_local_path(data_cfg.path)
    _check_text_unit(data_cfg.path, fmt, data_cfg.text_unit)


def _check_text_unit(path: str, fmt: str, text_unit: str) -> None:
    """``data.text_unit`` other than paragraph is for .txt files: JSON and Parquet records are documents
    already."""
    if text_unit != "paragraph" and fmt != "text":
        raise DataError(f"data.text_unit={text_unit} applies to .txt files; data.path={path} holds {fmt} "
                        "records, each one document already", hint="drop data.text_unit")


def _records(ds: Any, start: int, field: str) -> Iterator[Any]:
    """The ``field`` of each record of a ``datasets`` stream from record ``start`` on (skipped lazily)."""
    if start:
        ds = ds.skip(start)
    for record in ds:
        yield record.get(field)


class LocalSource:
    """Local JSONL/JSON, Parquet or text files (``.txt``: one document per paragraph, or per file with
    ``text_unit="file"``).

    JSON is read line by line with the ``json`` module: a malformed line is yielded as :class:`Malformed`
    (skipped and counted by the loader) and reported by :meth:`warnings`. Parquet and text go through
    ``datasets`` streaming.
    """

    name = "local"
    finite = True
    tokenized = False
    one_length = False

    def __init__(self, path: str, text_field: str, text_unit: str = "paragraph") -> None:
        self.path, self.text_unit = path, text_unit
        self.format, self.files = _check_local_path(path)
        _check_text_unit(path, self.format, text_unit)
        self.ignored = ignored_local_files(path)
        self.field = "text" if self.format == "text" else text_field
        self._malformed: int | None = None  # malformed records in one full pass, once known
        self._first_bad: Malformed | None = None
        if self.format == "json":
            self._check_json_field()
            if sum(Path(f).stat().st_size for f in self.files) <= EAGER_SCAN_BYTES:
                for _ in self._json_documents(0):  # count malformed lines now: the warning is exact at once
                    pass
        else:
            self._check_field()

    def _dataset(self) -> Any:
        from datasets import load_dataset

        kwargs: dict[str, Any] = {}
        if self.format == "text":
            # undecodable bytes become U+FFFD, which clean_text counts as invalid_utf8
            by = "document" if self.text_unit == "file" else "paragraph"
            kwargs = {"sample_by": by, "encoding_errors": "replace"}
        try:
            return load_dataset(self.format, data_files=self.files, split="train", streaming=True, **kwargs)
        except Exception as exc:
            raise DataError(
                f"data.path={self.path}: cannot read {self.format} files: {_one_line(exc)}"
            ) from None

    def _check_field(self) -> None:
        try:
            first = next(iter(self._dataset()), None)
        except DataError:
            raise
        except Exception as exc:
            raise DataError(
                f"data.path={self.path}: cannot read {self.format} files: {_one_line(exc)}"
            ) from None
        if first is None:
            raise DataError(f"data.path={self.path} holds no records", hint="check the files are not empty")
        if self.field not in first:
            raise DataError(
                f"data.text_field={self.field!r} is not a field of {self.path} (fields: {', '.join(first)})",
                hint="set data.text_field to the field holding the text",
            )

    def _check_json_field(self) -> None:
        fields: dict[str, None] = {}  # ordered set
        good = 0
        for record in _json_records(self.files):
            if isinstance(record, Malformed):
                continue
            if self.field in record:
                return
            fields.update(dict.fromkeys(record))
            good += 1
            if good >= FIELD_PROBE_RECORDS:
                break
        shown = ", ".join(list(fields)[:20]) + (", ..." if len(fields) > 20 else "")
        raise DataError(
            f"data.text_field={self.field!r} is not a field of {self.path} (fields: {shown})",
            hint="set data.text_field to the field holding the text",
        )

    def _json_documents(self, start: int) -> Iterator[Any]:
        tally = start == 0  # only a pass from the first record counts the malformed ones
        bad = 0
        for record in _json_records(self.files, start):
            if isinstance(record, Malformed):
                if tally:
                    bad += 1
                    if self._first_bad is None:
                        self._first_bad = record
                yield record
            else:
                yield record.get(self.field)
        if tally:
            self._malformed = bad

    def documents(self, start: int) -> Iterator[Any]:
        if self.format == "json":
            return self._json_documents(start)
        return _records(self._dataset(), start, self.field)

    def warnings(self) -> list[str]:
        """One line once malformed records were met: their count per pass and the first one's location."""
        first = self._first_bad
        if first is None:
            return []
        if self._malformed is None:
            return [
                f"data.path={self.path}: skipping malformed JSON lines (first: {first.where()}); "
                "the count follows after a full pass"
            ]
        return [
            f"data.path={self.path}: {self._malformed} malformed JSON line(s) skipped in each pass "
            f"(first: {first.where()})"
        ]

    def describe(self) -> str:
        unit = ", one document per file" if self.text_unit == "file" else ""
        return (f"local: {self.format} at {self.path}, field {self.field!r}{unit}: "
                f"{describe_files(self.files, self.ignored)}")


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def first_record_within(fn: Any, timeout_s: float, what: str) -> tuple[Any, float]:
    """Run ``fn()`` in a daemon thread; its result and seconds taken, or DataError after ``timeout_s``."""
    box: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)

    def work() -> None:
        try:
            box.put((True, fn()))
        except BaseException as exc:
            box.put((False, exc))

    t0 = time.perf_counter()
    threading.Thread(target=work, name="nsa-data-probe", daemon=True).start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise DataError(f"{what}: no data within data.timeout_s={timeout_s:g}s", hint=OFFLINE_HINT) from None
    if not ok:
        raise DataError(f"{what} is unreachable: {_one_line(value)}", hint=OFFLINE_HINT) from None
    return value, time.perf_counter() - t0


class HFStreamSource:
    """A Hugging Face dataset streamed with ``load_dataset(..., streaming=True)`` (fineweb-edu by default)."""

    name = "fineweb_edu"
    finite = True
    tokenized = False
    one_length = False

    def __init__(
        self, dataset: str, config: str | None, split: str, text_field: str, timeout_s: float
    ) -> None:
        self.dataset, self.config, self.split, self.field = dataset, config, split, text_field
        self.label = f"{dataset}/{config} split {split}"
        first, self.first_s = first_record_within(
            lambda: next(iter(self._dataset()), None), timeout_s, f"data source {self.label}"
        )
        if first is None:
            raise DataError(f"{self.label} is empty", hint="check data.hf_dataset, hf_config and hf_split")
        if self.field not in first:
            raise DataError(
                f"data.text_field={self.field!r} is not a field of {self.label} (fields: {', '.join(first)})",
                hint="set data.text_field",
            )

    def _dataset(self) -> Any:
        from datasets import load_dataset

        return load_dataset(self.dataset, self.config, split=self.split, streaming=True)

    def documents(self, start: int) -> Iterator[Any]:
        return _records(self._dataset(), start, self.field)

    def describe(self) -> str:
        return f"fineweb_edu: {self.label} reachable (first record in {self.first_s:.1f}s)"


class SyntheticSource:
    """Token documents of exactly ``seq_len`` tokens, episode ``i`` generated from ``(seed, i)``.

    ``random``: uniform tokens (nothing to learn). ``assoc_recall``: ``n`` key/value pairs, a gap of
    one repeated filler token, then every key once more (shuffled) each followed by its value::

        k1 v1 ... kn vn  g g ... g  q1 a1 ... qn an      (n = clamp(seq_len // 16, 1, 8))

    Each answer is ``seq_len - 4n`` or more tokens after its pair, so only attention that reaches back
    past the gap (beyond a sliding window shorter than that) can predict it.
    ``needle``: ``nsa.data.retrieval.needle_episode`` with the needle at a random depth (one answer, the
    last target): uniform, but ``needle_edges`` of the episodes at depth 0 or 1 exactly. ``mqar``:
    ``mqar_episode`` with ``pairs`` pairs scattered over the sequence and all of them asked at the end.
    Both use the top of the vocabulary for keys and values (``TaskLayout``), the same layout ``nsa eval``
    asks with.
    """

    name = "synthetic"
    finite = False
    tokenized = True
    one_length = True
    KEY_IDS = 16  # keys and values each come from 16 token ids
    MAX_PAIRS = 8  # a 2-layer d=64 transformer learns recall across a 96-token gap in ~2k steps of batch 32

    def __init__(self, task: str, seed: int, seq_len: int, vocab_size: int, eot_id: int, pairs: int = 8,
                 needle_edges: float = DataConfig.model_fields["needle_edges"].default) -> None:
        if seq_len < 8:
            raise DataError(f"synthetic data needs train.seq_len >= 8, got {seq_len}")
        self.task, self.seed, self.seq_len, self.needle_edges = task, seed, seq_len, needle_edges
        alphabet = np.array([t for t in range(min(vocab_size, 256)) if t != eot_id], dtype=np.int64)
        if len(alphabet) < 2 * self.KEY_IDS + 1:
            raise DataError(f"synthetic data needs a vocabulary of at least 34 tokens, got {vocab_size}")
        self.alphabet = alphabet
        self.gap = int(alphabet[0])
        self.keys = alphabet[1 : 1 + self.KEY_IDS]
        self.values = alphabet[1 + self.KEY_IDS : 1 + 2 * self.KEY_IDS]
        self.n_pairs = max(1, min(seq_len // 16, self.MAX_PAIRS))
        self.query_start = seq_len - 2 * self.n_pairs
        if task in ("needle", "mqar"):
            self.layout = TaskLayout.for_vocab(vocab_size, eot_id)
            self.n_pairs = pairs if task == "mqar" else 1
            self.query_start = seq_len - 2 * self.n_pairs
            if task == "mqar" and self.query_start // 2 < pairs:
                raise DataError(f"synthetic_task=mqar: train.seq_len={seq_len} is too short for {pairs} "
                                "pairs", hint="lower data.synthetic_pairs or raise train.seq_len")

    def episode(self, index: int) -> np.ndarray:
        """Document ``index``: ``seq_len`` token ids (int64)."""
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, index])
        if self.task == "random":
            return rng.choice(self.alphabet, size=self.seq_len)
        if self.task in ("needle", "mqar"):
            import torch


            gen = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
            if self.task == "needle":
                tokens, _ = needle_episode(self.layout, gen, self.seq_len,
                                           self.needle_depth(float(rng.random())))
            else:
                tokens, _ = mqar_episode(self.layout, gen, self.seq_len, self.n_pairs)
            return tokens.numpy().astype(np.int64)
        n = self.n_pairs
        keys = rng.choice(self.keys, size=n, replace=False)
        vals = rng.choice(self.values, size=n)
        order = rng.permutation(n)
        out = np.full(self.seq_len, self.gap, dtype=np.int64)
        out[0 : 2 * n : 2], out[1 : 2 * n : 2] = keys, vals
        out[self.query_start :: 2], out[self.query_start + 1 :: 2] = keys[order], vals[order]
        return out

    def needle_depth(self, u: float) -> float:
        """The depth of a needle episode from one uniform draw ``u``: ``needle_edges / 2`` of them at 0,
        as many at 1, the rest uniform over [0, 1]."""
        e = self.needle_edges
        if u < e:
            return 0.0 if u < e / 2 else 1.0
        return (u - e) / (1.0 - e)

    def target_mask(self) -> list[bool] | None:
        """Per target position ``t`` of a packed sequence: True where ``y[:, t]`` is an answer (``None``
        for ``random``, which has none).

        Episodes fill whole sequences (episode + separator = ``seq_len + 1`` tokens), so this holds for
        every row; the loss on these positions falls only with recall across the gap.
        """
        if self.task == "random":
            return None
        start = self.query_start
        return [t >= start and (t - start) % 2 == 0 for t in range(self.seq_len)]

    def documents(self, start: int) -> Iterator[Any]:
        index = start
        while True:
            yield self.episode(index)
            index += 1

    def describe(self) -> str:
        detail = {
            "assoc_recall": f", {self.n_pairs} pairs recalled across a "
                            f"{self.query_start - 2 * self.n_pairs}-token gap",
            "needle": ", one key/value needle at a random depth, asked at the end",
            "mqar": f", {self.n_pairs} key/value pairs scattered, all asked at the end",
        }.get(self.task, "")
        return f"synthetic: {self.task}, seed {self.seed}, {self.seq_len} tokens per episode{detail}"


def _synthetic(cfg: DataConfig, seed: int, seq_len: int, vocab_size: int, eot_id: int) -> SyntheticSource:
    return SyntheticSource(cfg.synthetic_task, seed, seq_len, vocab_size, eot_id, cfg.synthetic_pairs,
                           cfg.needle_edges)


def _hf_source(cfg: DataConfig) -> HFStreamSource:
    return HFStreamSource(cfg.hf_dataset, cfg.hf_config, cfg.hf_split, cfg.text_field, cfg.timeout_s)


def open_source(
    cfg: DataConfig, *, seed: int, seq_len: int, vocab_size: int, eot_id: int
) -> tuple[Source, list[str]]:
    """The configured source and any warnings (a fallback to synthetic data is one, to record loudly)."""
    if cfg.source == "embedded":
        return EmbeddedSource(), []
    if cfg.source == "local":
        if not cfg.path:
            raise DataError("data.path is required when data.source=local")
        return LocalSource(cfg.path, cfg.text_field, cfg.text_unit), []
    if cfg.source == "synthetic":
        return _synthetic(cfg, seed, seq_len, vocab_size, eot_id), []
    if cfg.source == "fineweb_edu":
        try:
            return _hf_source(cfg), []
        except DataError as exc:
            if not cfg.synthetic_on_fail:
                raise
            warning = (
                f"data source fineweb_edu failed ({exc.message}); TRAINING ON SYNTHETIC "
                f"{cfg.synthetic_task} DATA INSTEAD (data.synthetic_on_fail=true)"
            )
            return _synthetic(cfg, seed, seq_len, vocab_size, eot_id), [warning]
    raise DataError(f"unknown data.source={cfg.source!r}")


def open_source_probe(data_cfg: DataConfig, timeout_s: float) -> str:
    """Quick reachability check for ``nsa preflight``: a one-line description, or DataError."""
    cfg = data_cfg.model_copy(update={"timeout_s": timeout_s, "synthetic_on_fail": False})
    if cfg.source == "synthetic":
        return f"synthetic: {cfg.synthetic_task} (generated, always available)"
    try:
        source, _ = open_source(cfg, seed=0, seq_len=128, vocab_size=256, eot_id=0)
    except DataError as exc:
        if data_cfg.source == "fineweb_edu" and data_cfg.synthetic_on_fail:
            exc.hint = "data.synthetic_on_fail=true: a run would train on synthetic data instead"
        raise
    return source.describe()
