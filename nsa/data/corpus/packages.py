"""Build a text corpus offline from the files of the installed Python distributions.

The builder walks the distributions of an environment (``importlib.metadata``), keeps their text files
(source, stubs, C/CUDA, docs; UTF-8, no NUL, no very long line, within a size range), drops exact
duplicates, shuffles the documents with a fixed seed and writes them as JSONL shards plus a manifest::

    python -m nsa.data.corpus.packages OUT [--min-mb 300] [--max-mb N] [--seed 0] [--val-fraction 0.02]
                                           [--path SITE_PACKAGES ...]

    OUT/text/part-000.jsonl, part-001.jsonl, ...   one {"text": ..., "source": "<pkg>==<ver>:<path>"} a line
    OUT/manifest.json                              packages, totals, held-out share, sha256 of the texts

Train on it (or pass the same ``--set`` to ``nsa bench quality``) with
``--set data.source=local --set data.path=OUT/text --set data.val_fraction=<same> --set data.tokenizer=byte``:
the loader reads the shards in name order, one document per line, and holds out exactly the files that
``manifest.json`` counts under ``held_out``. The result is the same for one environment, seed and options.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import random
import re
import shutil
import stat
import sys
import time
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nsa.data.split import is_val
from nsa.errors import DataError

SUFFIXES = (".py", ".pyi", ".pyx", ".pxd", ".md", ".rst", ".txt", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu",
            ".cuh")
DATA_PATH = "text"  # the shards' folder inside OUT: what data.path points at
SIZE_HINT = "install more packages into the environment, add --path folders, or pass a smaller --min-mb"


@dataclass
class CorpusFile:
    """One text file of a distribution; ``path`` is relative to site-packages, as in its RECORD."""

    package: str
    version: str
    path: str
    text: str

    @property
    def source(self) -> str:
        """``<package>==<version>:<path>``."""
        return f"{self.package}=={self.version}:{self.path}"


def _normalised(name: str) -> str:
    """The PEP 503 form of a distribution name (``Foo_Bar`` and ``foo-bar`` are one distribution)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _read_text(file: Path, min_bytes: int, max_bytes: int, max_line: int) -> str | None:
    """The text of ``file`` when it passes the filters, else None (unreadable files included)."""
    try:
        info = file.stat()
        if not stat.S_ISREG(info.st_mode) or not min_bytes <= info.st_size <= max_bytes:
            return None
        data = file.read_bytes()
    except OSError:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    # U+FFFD is what the loader takes for a decoding error (nsa.data.records.clean_text): it would skip it
    if "\x00" in text or "\ufffd" in text:
        return None
    if max((len(line) for line in text.splitlines()), default=0) > max_line:
        return None
    return text


def iter_package_files(
    paths: list[str] | None = None,
    suffixes: Collection[str] = SUFFIXES,
    min_bytes: int = 512,
    max_bytes: int = 1_000_000,
    max_line: int = 1000,
) -> Iterator[CorpusFile]:
    """The text files of the distributions found on ``paths`` (None: ``sys.path``), in a fixed order.

    Distributions are sorted by normalised name then version, a name seen twice taken once; their RECORD
    files are sorted by path. A file is kept when its suffix (lowercase) is in ``suffixes``, it exists,
    has ``min_bytes`` to ``max_bytes`` bytes, decodes as UTF-8 and holds no NUL, no U+FFFD and no line
    over ``max_line`` characters (generated tables, minified data).
    """
    wanted = {s.lower() for s in suffixes}
    found = (importlib.metadata.distributions() if paths is None
             else importlib.metadata.distributions(path=paths))
    dists: list[tuple[str, str, str, importlib.metadata.Distribution]] = []
    for dist in found:
        name = dist.metadata["Name"]
        if name:
            dists.append((_normalised(name), dist.version or "", name, dist))
    dists.sort(key=lambda d: (d[0], d[1]))  # stable: of two equal ones, the first on the path comes first
    seen: set[str] = set()
    for key, version, name, dist in dists:
        if key in seen:
            continue
        seen.add(key)
        files = dist.files
        if files is None:
            continue
        for f in sorted(files, key=lambda p: p.as_posix()):
            if f.suffix.lower() not in wanted:
                continue
            text = _read_text(Path(str(dist.locate_file(f))), min_bytes, max_bytes, max_line)
            if text is not None:
                yield CorpusFile(package=name, version=version, path=f.as_posix(), text=text)


def _check_out(out: Path) -> None:
    """DataError unless ``out`` is absent or an empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} exists and is not an empty folder",
                        hint="give a new folder, or remove that one first")


def _write(tmp: Path, docs: list[tuple[CorpusFile, int]], shard_bytes: int) -> tuple[list[str], str]:
    """Write ``docs`` as JSONL shards under ``tmp/text``; the shard names and the sha256 of the texts (each
    text's UTF-8 followed by one NUL byte, in order)."""
    groups: list[list[CorpusFile]] = []
    size = shard_bytes
    for doc, nbytes in docs:
        if size >= shard_bytes:  # the current shard is full: a new one
            groups.append([])
            size = 0
        groups[-1].append(doc)
        size += nbytes
    folder = tmp / DATA_PATH
    folder.mkdir()
    digest = hashlib.sha256()
    width = max(3, len(str(len(groups) - 1)))  # zero-padded: the loader reads the files in name order
    shards = [f"part-{i:0{width}d}.jsonl" for i in range(len(groups))]
    for shard, group in zip(shards, groups, strict=True):
        with open(folder / shard, "w", encoding="utf-8", newline="\n") as fh:
            for doc in group:
                fh.write(json.dumps({"text": doc.text, "source": doc.source}, ensure_ascii=False) + "\n")
                digest.update(doc.text.encode("utf-8") + b"\x00")
    return shards, digest.hexdigest()


def build_corpus(
    out: Path,
    *,
    paths: list[str] | None = None,
    min_total_bytes: int = 300_000_000,
    max_total_bytes: int | None = None,
    shard_bytes: int = 64_000_000,
    seed: int = 0,
    val_fraction: float = 0.02,
    suffixes: Collection[str] = SUFFIXES,
) -> dict[str, Any]:
    """Collect, deduplicate (sha256 of the text, first kept), shuffle (``random.Random(seed)``), optionally
    cut at ``max_total_bytes`` (before the first document that would pass it) and write the corpus to
    ``out``; returns the manifest (also ``out/manifest.json``).

    Nothing is written when the total is below ``min_total_bytes`` (DataError). The corpus is written to a
    temporary folder next to ``out`` and renamed into place at the end; ``out`` must be absent or empty.
    ``held_out`` counts the documents ``nsa.data.split.is_val(index, val_fraction)`` takes, ``index`` being
    the position in the written order: the files a run with ``data.val_fraction`` the same holds out.
    """
    out = Path(out)
    _check_out(out)
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} is outside [0, 1)",
                        hint="e.g. 0.02, as data.val_fraction")
    if max_total_bytes is not None and max_total_bytes < min_total_bytes:
        raise DataError(f"the maximum ({max_total_bytes:,} bytes) is below the minimum ({min_total_bytes:,} "
                        "bytes)", hint="raise --max-mb or lower --min-mb")
    docs: list[tuple[CorpusFile, int]] = []
    seen: set[bytes] = set()
    duplicates = 0
    for file in iter_package_files(paths, suffixes):
        data = file.text.encode("utf-8")
        key = hashlib.sha256(data).digest()
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        docs.append((file, len(data)))
    random.Random(seed).shuffle(docs)
    if max_total_bytes is not None:
        total = 0
        for keep, (_, nbytes) in enumerate(docs):
            if total + nbytes > max_total_bytes:
                docs = docs[:keep]
                break
            total += nbytes
    total = sum(nbytes for _, nbytes in docs)
    if total < min_total_bytes:
        where = "sys.path" if paths is None else ", ".join(paths)
        raise DataError(
            f"the installed packages give {total:,} bytes of text in {len(docs):,} files on {where}, "
            f"below the minimum of {min_total_bytes:,} bytes",
            hint=SIZE_HINT,
        )
    packages: dict[tuple[str, str], dict[str, Any]] = {}
    held_files = held_bytes = 0
    for index, (doc, nbytes) in enumerate(docs):
        entry = packages.setdefault((doc.package, doc.version),
                                    {"name": doc.package, "version": doc.version, "files": 0, "bytes": 0})
        entry["files"] += 1
        entry["bytes"] += nbytes
        if is_val(index, val_fraction):
            held_files += 1
            held_bytes += nbytes
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        shards, digest = _write(tmp, docs, shard_bytes)
        manifest: dict[str, Any] = {
            "packages": sorted(packages.values(), key=lambda p: (-p["bytes"], p["name"], p["version"])),
            "files": len(docs),
            "bytes": total,
            "duplicates_dropped": duplicates,
            "suffixes": list(suffixes),
            "seed": seed,
            "val_fraction": val_fraction,
            "held_out": {"files": held_files, "bytes": held_bytes},
            "python": sys.version,
            "sha256": digest,
            "data_path": DATA_PATH,
            "shards": shards,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
        _check_out(out)  # again: something may have appeared there meanwhile
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def main(argv: list[str] | None = None) -> None:
    """``python -m nsa.data.corpus.packages OUT ...``: build the corpus, print the largest packages and a
    summary; a DataError is one ``error:`` line on stderr and exit code 2."""
    parser = argparse.ArgumentParser(
        prog="python -m nsa.data.corpus.packages",
        description="Build a JSONL text corpus from the files of the installed Python distributions.",
    )
    parser.add_argument("out", type=Path, metavar="OUT",
                        help="new (or empty) folder for text/ and manifest.json")
    parser.add_argument("--min-mb", type=float, default=300.0,
                        help="fail below this many MB of text (default 300)")
    parser.add_argument("--max-mb", type=float, default=None, help="stop at this many MB of text")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    parser.add_argument("--val-fraction", type=float, default=0.02,
                        help="the data.val_fraction the run will use, for the held-out count (default 0.02)")
    parser.add_argument("--path", action="append", dest="paths", metavar="DIR",
                        help="a site-packages folder to read instead of sys.path (repeatable)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        manifest = build_corpus(
            args.out,
            paths=args.paths,
            min_total_bytes=int(args.min_mb * 1e6),
            max_total_bytes=None if args.max_mb is None else int(args.max_mb * 1e6),
            seed=args.seed,
            val_fraction=args.val_fraction,
        )
    except DataError as exc:
        print(f"error: {exc.one_line()}", file=sys.stderr)
        raise SystemExit(2) from None
    seconds = time.perf_counter() - t0
    for p in manifest["packages"][:15]:
        print(f"{p['name']}=={p['version']}: {p['files']:,} files, {p['bytes'] / 1e6:.1f} MB")
    held = manifest["held_out"]
    print(
        f"{args.out}: {manifest['files']:,} files, {manifest['bytes'] / 1e6:.1f} MB in "
        f"{len(manifest['shards'])} shard(s) from {len(manifest['packages'])} packages; held out "
        f"{held['files']:,} files, {held['bytes'] / 1e6:.1f} MB (val_fraction {manifest['val_fraction']:g}); "
        f"{manifest['duplicates_dropped']:,} duplicates dropped; {seconds:.1f}s"
    )


if __name__ == "__main__":
    main()
