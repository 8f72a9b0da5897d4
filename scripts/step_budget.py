"""The budget of a training step (issue 52): NSA and dense, and NSA with one piece changed at a time, each
compiled, timed alone on its GPU and profiled, with the device time by part (`nsa.bench.step_parts`).

Usage (repo root, CUDA machine):
    python3 scripts/step_budget.py OUT.json [--shape m7c|quality] [--seq-lens 2048,8192] [--tokens 32768]
        [--variants dense,nsa,...] [--parallel 4] [--steps 20] [--set key=value ...] [--config m7c-125m] [--eager]

Every variant x length runs in a process of its own (`nsa.bench.fanout`), `--parallel` at a time dealt over the
GPUs; they compile side by side and take turns to time (`nsa.bench.timing.device_turn`), so no timing shares a
GPU. The batch at each length holds `--tokens` tokens. A variant's step minus NSA's is what that piece costs
(`nsa-noalign`: the alignment loss; `nsa-onequery`: the window's own query; `nsa-fixedgates`: the gate MLP).
Prints a markdown table of ms per part and variant, and writes every row (kernels, parts) to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

SHAPES: dict[str, list[str]] = {
    "m7c": [],
    # scripts/quality_text_gpu.sh's model: the judge of recipes at equal time
    "quality": ["model.dim=384", "model.n_layers=6", "model.n_heads=6", "model.n_kv_groups=2", "model.d_k=64",
                "model.d_v=64", "model.mlp_hidden=1536"],
}
ALL_NSA = ["model.attention=nsa", "model.dense_layers=[]"]  # every block NSA (m7c-125m's default is the hybrid)
VARIANTS: dict[str, list[str]] = {  # nsa*: every block NSA; hybrid*: every other block dense
    "dense": ["model.attention=dense"],
    "nsa": ALL_NSA,
    "nsa-noalign": [*ALL_NSA, "scorer.align=0"],
    "nsa-onequery": [*ALL_NSA, "nsa.window_query=false"],
    "nsa-fixedgates": [*ALL_NSA, "nsa.fixed_gates=[0.3,0.3,0.3]"],
    "nsa-nsel8": [*ALL_NSA, "nsa.n_sel=8"],
    "nsa-w256": [*ALL_NSA, "nsa.w=256"],
    "nsa-sharedkv": [*ALL_NSA, "nsa.shared_kv=true"],
    "nsa-selrow": ALL_NSA,
    "dense-graphs": ["model.attention=dense", "runtime.compile_mode=reduce-overhead"],
    "nsa-graphs": [*ALL_NSA, "runtime.compile_mode=reduce-overhead"],
    "nsa-graphs-nsel8": [*ALL_NSA, "runtime.compile_mode=reduce-overhead", "nsa.n_sel=8"],
    "nsa-graphs-sharedkv": [*ALL_NSA, "runtime.compile_mode=reduce-overhead", "nsa.shared_kv=true"],
    "hybrid": ["model.attention=nsa", "model.dense_layers=even"],
    "hybrid-graphs": ["model.attention=nsa", "model.dense_layers=even", "runtime.compile_mode=reduce-overhead"],
    "hybrid-graphs-nsel8": ["model.attention=nsa", "model.dense_layers=even", "runtime.compile_mode=reduce-overhead",
                            "nsa.n_sel=8"],
    "thirds-graphs": ["model.attention=nsa", "model.dense_layers=thirds", "runtime.compile_mode=reduce-overhead"],
    "thirds-graphs-nsel8": ["model.attention=nsa", "model.dense_layers=thirds", "runtime.compile_mode=reduce-overhead",
                            "nsa.n_sel=8"],
}
for _v in ("nsa-graphs", "hybrid-graphs"):  # the projection's parts split and rotated unfused (before nsa::split_rotate)
    VARIANTS[f"{_v}-unfused"] = VARIANTS[_v]
UNFUSED = {"nsa-graphs-unfused", "hybrid-graphs-unfused"}
# the op's former host paths (the work list by PyTorch operators, split_rotate a launch per part): the fourth stop's
# host-time cuts measured against them
VARIANTS["hybrid-graphs-oldhost"] = VARIANTS["hybrid-graphs"]
VARIANTS["hybrid-oldhost"] = VARIANTS["hybrid"]
TUNES: dict[str, dict[str, int | str]] = {  # tile overrides of a variant (nsa.ops.TUNE_KEYS)
    "nsa-selrow": {"sel_mode": "row"},
    "hybrid-graphs-oldhost": {"sel_wl": "ops", "rot_launch": "parts"},
    "hybrid-oldhost": {"sel_wl": "ops", "rot_launch": "parts"},
}


def one(config: str, shape: str, sets: list[str], name: str, seq_len: int, batch: int, steps: int,
        compiled: bool) -> dict[str, Any]:
    """One variant at one length, in its worker process."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "4")
    from nsa.bench.timing import device_turn
    from nsa.bench.train import bench_train_step
    from nsa.config import load_run_config
    from nsa.model.attention import fused_projection

    fused_projection(name not in UNFUSED)

    cfg = load_run_config(config=config, sets=[*SHAPES[shape], *sets, *VARIANTS[name]]).config
    row = bench_train_step(cfg, attention=cfg.model.attention, seq_len=seq_len, batch_size=batch, steps=steps,
                           warmup=3, compiled=compiled, profile=True, hold=device_turn,
                           tune=TUNES.get(name))
    return {"variant": name, "shape": shape, **asdict(row)}


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per length, a column per variant; step ms, tokens/s vs dense, then ms per part."""
    out = []
    for S in sorted({r["seq_len"] for r in rows}):
        at = [r for r in rows if r["seq_len"] == S and not r.get("error")]
        dense = next((r for r in at if r["variant"] == "dense"), None)
        parts = sorted({p for r in at for p in (r.get("parts") or {}) if p != "launches"},
                       key=lambda p: -max((r.get("parts") or {}).get(p, 0.0) for r in at))
        out.append(f"\n**S={S}, batch {at[0]['batch_size'] if at else '?'}**\n")
        out.append("| | " + " | ".join(r["variant"] for r in at) + " |")
        out.append("|---" * (len(at) + 1) + "|")
        out.append("| step ms | " + " | ".join(f"{r['step_ms']:.1f}" for r in at) + " |")
        out.append("| tokens/s | " + " | ".join(f"{r['tokens_per_s']:,.0f}" for r in at) + " |")
        if dense:
            out.append("| vs dense | " + " | ".join(f"{r['tokens_per_s'] / dense['tokens_per_s']:.2f}x"
                                                    for r in at) + " |")
        out.append("| launches | " + " | ".join(f"{(r.get('parts') or {}).get('launches', 0):.0f}" for r in at) + " |")
        for p in parts:
            out.append(f"| {p} | " + " | ".join(f"{(r.get('parts') or {}).get(p, 0.0):.2f}" for r in at) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--config", default="m7c-125m")
    ap.add_argument("--shape", default="m7c", choices=sorted(SHAPES))
    ap.add_argument("--eager", action="store_true", help="no torch.compile (a CPU check of the script)")
    ap.add_argument("--seq-lens", default="2048,8192")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per batch at every length")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args()
    from nsa.bench import fanout

    names = [v for v in a.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        sys.exit(f"error: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    jobs = [(a.config, a.shape, a.sets, v, int(S), max(1, a.tokens // int(S)), a.steps, not a.eager)
            for S in a.seq_lens.split(",") for v in names]
    rows: list[dict[str, Any]] = []

    def done(_i: int, row: dict[str, Any]) -> None:
        rows.append(row)
        print(f"{row['shape']} S={row['seq_len']} {row['variant']}: {row['step_ms']:.1f} ms, "
              f"{row['tokens_per_s']:,.0f} tok/s, compile {row.get('compile_s') or 0:.0f} s", flush=True)
        with open(a.out + ".rows.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")

    fanout.spread(one, jobs, min(a.parallel, len(jobs)), on_start=print, on_done=done)
    order = {v: i for i, v in enumerate(names)}
    rows.sort(key=lambda r: (r["seq_len"], order[r["variant"]]))
    from nsa.envinfo import environment

    with open(a.out, "w") as fh:
        json.dump({"command": " ".join(sys.argv), "environment": environment(), "rows": rows}, fh, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
