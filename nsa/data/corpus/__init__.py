"""The corpus shipped inside the package (standard-library docstrings, PSF licence)."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

CORPUS_FILE = Path(__file__).with_name("stdlib_docs.jsonl.gz")


@functools.lru_cache(maxsize=1)
def load_corpus() -> tuple[str, ...]:
    """All documents of the embedded corpus, in their fixed order."""
    with gzip.open(CORPUS_FILE, "rt", encoding="utf-8") as fh:
        return tuple(json.loads(line)["text"] for line in fh if line.strip())
