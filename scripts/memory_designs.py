"""Issue 53's memory row at the m7c shape: the selected branch's per-pair buffers, designs timed in one process.

At m7c 64k the FSA order (small groups: ``sel_mode=fsa``) keeps two per-pair buffers of 1.6 GB each, the
forward's partial outputs and the backward's dq partials; the op's peak is 4.4x dense's where the target is 2x.
Each design is a set of tile overrides (:func:`nsa.ops.tile_overrides`): the op's fwd+bwd time and peak memory
(``nsa.bench.attention.bench_one``) and the selected branch's stages alone (``kernel_breakdown``), dense SDPA once
per shape for the ratios.

Usage (repo root, GPU): python3 scripts/memory_designs.py [m7c:65536 m7c:131072 ...]   JSON lines to
$OUT/memory.jsonl (or ./memory.jsonl).
"""

from __future__ import annotations

import json
import os
import sys
from typing import TextIO

DESIGNS: dict[str, dict[str, int | str]] = {
    "default": {},
    "dq-atomic": {"sel_dq": "atomic"},
    "dq-atomic+fwd-chunks-256": {"sel_dq": "atomic", "sel_partial_mib": 256},
    "dq-atomic+fwd-chunks-128": {"sel_dq": "atomic", "sel_partial_mib": 128},
    "chunks-256": {"sel_partial_mib": 256},
    "dq-row": {"sel_dq": "row"},
    "dq-row+fwd-chunks-256": {"sel_dq": "row", "sel_partial_mib": 256},
    "row-mode": {"sel_mode": "row"},
}


def main(argv: list[str]) -> None:
    only = os.environ.get("MEMORY_DESIGNS")
    names = only.split(",") if only else list(DESIGNS)
    with open(os.path.join(os.environ.get("OUT", "."), "memory.jsonl"), "a") as out:
        _designs(argv, names, out)


def _designs(argv: list[str], names: list[str], out: TextIO) -> None:
    from nsa.bench.attention import bench_one, kernel_breakdown
    from nsa.bench.requests import SHAPES
    from nsa.ops import tile_overrides

    for spec in argv or ["m7c:65536"]:
        shape, s = spec.split(":")
        S = int(s)
        HQ, H, D = SHAPES[shape]
        dense = bench_one(shape, S, HQ, H, D, peer=False, dense=True)
        base = {"shape": shape, "S": S, "dense_fwdbwd_ms": dense.dense_fwdbwd_ms,
                "dense_peak_mib": dense.dense_peak_mib}
        print(json.dumps(base), flush=True)
        for name in names:
            tune = DESIGNS[name]
            if tune:
                with tile_overrides(tune):
                    row = bench_one(shape, S, HQ, H, D, peer=False, dense=False)
            else:  # the dense run timed the default op already
                row = dense
            stages = kernel_breakdown(S, HQ, H, D, only=("sel_fwd", "sel_bwd"), tune=tune)
            rec = dict(base, design=name, tune=tune, fwd_ms=row.nsa_fwd_ms, fwdbwd_ms=row.nsa_fwdbwd_ms,
                       peak_mib=row.nsa_peak_mib, fallbacks=row.fallbacks, stages_ms=stages,
                       vs_dense=(dense.dense_fwdbwd_ms or 0) / (row.nsa_fwdbwd_ms or 1),
                       peak_vs_dense=(row.nsa_peak_mib or 0) / (dense.dense_peak_mib or 1))
            print(json.dumps(rec), flush=True)
            out.write(json.dumps(rec) + "\n")
            out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
