"""Gate-recipe sweep on key/value retrieval beyond the window: steps to a target accuracy per
(shape, candidate, seed), many runs in parallel processes (CPU cores, or one GPU shared).

    python scripts/retrieval_sweep.py SPEC.json OUT.jsonl [--device cpu|cuda] [--workers N]

SPEC: {"shapes": ["test", ...], "seeds": [0, 1, 2, 3], "steps": 1000, "eval_every": 50,
       "candidates": [{"name": "dense", "variant": "dense"},
                      {"name": "slow", "nsa": {"gate_init": "slow"}},
                      {"name": "scorer", "nsa": {...}, "scorer": {"weight": 0.1, "queries": 16}}]}

A candidate may also carry "model" overrides and "recipe" fields. (The learning-dynamics variants a candidate
once patched into the layer, "patch", are gone: the layer's own nsa.window_query and nsa.kv_speed are the
measured recipe, docs/benchmarks/gates-h200.md; a candidate sets them under "nsa".)
Shapes: ``test`` is tests/test_retrieval_learning.py's (2 layers, dim 32, S=128, gap 48, w=16);
``s256`` a wider 2-layer model at S=256 (gap 96, w=32, the tiny config's NSA block sizes); ``needle2k``
``w64``/``w128`` the test's model with
a wider window (S=256 / 512); ``needle2k`` the retrieval config's 4-layer model at S=2048, gap 600 (`nsa bench retrieval`'s default). Each line of
OUT is one run (its curve included); the summary at the end gives steps to the target per seed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "test": dict(model=dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=8,
                            mlp_hidden=128, max_seq_len=128),
                 nsa=dict(l=8, d=4, l_sel=16, n_sel=4, w=16), task=dict(seq_len=128, gap=48), batch=16),
    "s256": dict(model=dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_groups=2, d_k=16, d_v=16,
                            mlp_hidden=192, max_seq_len=256),
                 nsa=dict(l=8, d=4, l_sel=16, n_sel=4, w=32), task=dict(seq_len=256, gap=96), batch=16),
    "w64": dict(model=dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=8,
                           mlp_hidden=128, max_seq_len=256),
                nsa=dict(l=8, d=4, l_sel=16, n_sel=4, w=64), task=dict(seq_len=256, gap=96), batch=16),
    "w128": dict(model=dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=8,
                            mlp_hidden=128, max_seq_len=512),
                 nsa=dict(l=8, d=4, l_sel=16, n_sel=8, w=128), task=dict(seq_len=512, gap=192), batch=16),
    "needle2k": dict(model=dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_groups=2, d_k=32, d_v=32,
                                max_seq_len=2048),
                     nsa=dict(), task=dict(seq_len=2048, gap=600), batch=16),
}


def run(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from nsa.bench.retrieval import RetrievalRecipe, learn_retrieval
    from nsa.config import ModelConfig, NSAConfig, ScorerConfig
    from nsa.data.retrieval import RetrievalTask

    sh, cand = SHAPES[job["shape"]], job["candidate"]
    if cand.get("patch"):
        raise SystemExit(f"candidate {cand['name']}: \"patch\" is gone; set nsa.window_query / nsa.kv_speed under "
                         "\"nsa\" instead")
    model = ModelConfig(**{**sh["model"], **cand.get("model", {})})
    nsa = NSAConfig(**{**sh["nsa"], **cand.get("nsa", {})})
    task = RetrievalTask(**sh["task"])
    recipe = RetrievalRecipe(steps=job["steps"], batch_size=sh["batch"], eval_every=job["eval_every"],
                             eval_samples=job.get("eval_samples", 128), target=job["target"], stop_at_target=True,
                             **cand.get("recipe", {}))
    variant = cand.get("variant", "nsa")
    scorer = ScorerConfig(**cand["scorer"]) if cand.get("scorer") else None
    backend = job["backend"] if variant != "dense" else None
    t0 = time.time()
    c = learn_retrieval(model, nsa, task, variant, recipe=recipe, seed=job["seed"], device=job["device"],
                        backend=backend, scorer=scorer)
    return dict(shape=job["shape"], name=cand["name"], spec=cand, seed=job["seed"], hit=c.steps_to_target,
                final=c.final_accuracy, gates=c.points[-1].gates if c.points else [], secs=round(time.time() - t0),
                curve=[(p.step, round(p.accuracy, 3), round(p.loss, 3)) for p in c.points])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    jobs = [dict(shape=shape, candidate=cand, seed=seed, steps=spec.get("steps", 1000),
                 eval_every=spec.get("eval_every", 50), target=spec.get("target", 0.5), device=args.device,
                 backend=spec.get("backend", "torch"))
            for shape in spec.get("shapes", ["test"]) for cand in spec["candidates"] for seed in spec["seeds"]]
    rows: list[dict[str, Any]] = []
    with open(args.out, "a") as out, ProcessPoolExecutor(args.workers) as ex:
        for r in ex.map(run, jobs):
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in ("curve", "spec")}), flush=True)
            out.write(json.dumps(r) + "\n")
            out.flush()
    print("\nsteps to target per seed (- = not reached):")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for name in dict.fromkeys(r["name"] for r in rows):
            mine = [r for r in rows if r["shape"] == shape and r["name"] == name]
            if mine:
                hits = " ".join("-" if r["hit"] is None else str(r["hit"]) for r in mine)
                reached = sum(r["hit"] is not None for r in mine)
                print(f"  {shape:9s} {name:24s} {hits:32s} reached {reached}/{len(mine)}", flush=True)


if __name__ == "__main__":
    main()
