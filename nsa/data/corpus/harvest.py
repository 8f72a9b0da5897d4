"""Build the embedded corpus from the docstrings of the installed Python standard library.

Run once at development time (``python -m nsa.data.corpus.harvest``); the result,
``stdlib_docs.jsonl.gz``, ships inside the package so that a first run needs no network.
The text is from the Python standard library (PSF licence, see ``LICENSE-PSF.txt``).
"""

from __future__ import annotations

import ast
import gzip
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

CORPUS_FILE = Path(__file__).with_name("stdlib_docs.jsonl.gz")
SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "turtledemo"}


def _docstrings(tree: ast.Module, module: str) -> Iterator[tuple[str, str]]:
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        yield module, doc
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield f"{module}.{node.name}", doc


def harvest_documents(root: Path, min_chars: int = 200) -> list[dict[str, str]]:
    """Docstrings of at least ``min_chars`` characters under ``root``, one document each, deduplicated."""
    seen: set[str] = set()
    docs: list[dict[str, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        for name, doc in _docstrings(tree, module):
            if len(doc) < min_chars or doc in seen:
                continue
            seen.add(doc)
            docs.append({"name": name, "text": doc})
    return docs


def write_corpus(docs: list[dict[str, str]], out: Path, max_chars: int, seed: int = 0) -> int:
    """Shuffle (fixed seed) and write up to ``max_chars`` characters of documents as gzipped JSONL."""
    order = list(docs)
    random.Random(seed).shuffle(order)
    total = 0
    written = 0
    with gzip.open(out, "wt", encoding="utf-8", compresslevel=9) as fh:
        for doc in order:
            if total + len(doc["text"]) > max_chars:
                break
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
            total += len(doc["text"])
            written += 1
    return written


def main() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = harvest_documents(root)
    n = write_corpus(docs, CORPUS_FILE, max_chars=5_000_000)
    print(f"wrote {n} documents to {CORPUS_FILE} ({CORPUS_FILE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
