"""Checkpoint save and load seconds of the trainer's own checkpoint code (issue 32): a model of ``--config`` (with
``--set`` overrides, e.g. a ~1B model) and its AdamW state after one step, written by
``nsa.train.checkpoint.save_checkpoint`` (one process: ``state.pt`` with its SHA-256 and manifest) or, under
``torchrun`` with ``runtime.parallel=fsdp``, by ``save_sharded_checkpoint`` (every rank its DCP shards), then
read back (``torch.load`` / ``load_sharded``). Prints one JSON line on rank 0.

    python3 scripts/ckpt_time.py --dir /tmp/ck --set model.dim=2048
    torchrun --nproc-per-node 2 scripts/ckpt_time.py --dir /tmp/ck --set runtime.parallel=fsdp
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from nsa.config import load_run_config
from nsa.model import build_model
from nsa.train import checkpoint as ckpt
from nsa.train import distributed as D
from nsa.train import parallel


def _sync(dev: str, info: D.DistInfo) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()
    D.barrier(info)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="m7c-125m")
    ap.add_argument("--dir", required=True, help="a scratch run directory (removed first)")
    ap.add_argument("--set", action="append", default=[], help="run-config override, as nsa train --set")
    args = ap.parse_args()
    cfg = load_run_config(args.config, environ={}, sets=["data.source=embedded", *args.set]).config
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    info = D.init(dev)
    run_dir = Path(args.dir)
    if info.is_main:
        shutil.rmtree(run_dir, ignore_errors=True)
    try:
        torch.manual_seed(0)
        model = build_model(cfg).to(dev)
        params = sum(p.numel() for p in model.parameters())
        sharded = parallel.sharded(cfg, info)
        if sharded:
            parallel.shard(model, cfg, "bf16" if dev == "cuda" else "fp32", dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, cfg.model.vocab_size, (1, 257), generator=torch.Generator().manual_seed(0)).to(dev)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
        opt.step()
        _sync(dev, info)
        t0 = time.perf_counter()
        if sharded:
            state = parallel.ShardedState(model, opt)
            path = ckpt.save_sharded_checkpoint(run_dir, 1, {"step": 1} if info.is_main else None,
                                                state.state_dict(), None, info)
        else:
            path = ckpt.save_checkpoint(run_dir, 1, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        _sync(dev, info)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if sharded:
            template = parallel.ShardedState(model, opt).state_dict()
            ckpt.load_sharded(path, template)
            parallel.ShardedState(model, opt).load_state_dict(template)
        else:
            whole = torch.load(path / ckpt.STATE_FILE, map_location=dev, weights_only=False)
            model.load_state_dict(whole["model"])
            opt.load_state_dict(whole["optimizer"])
        _sync(dev, info)
        load_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if info.is_main:
            print(json.dumps({"params_m": round(params / 1e6, 1), "world": info.world_size, "sharded": sharded,
                              "save_s": round(save_s, 2), "load_s": round(load_s, 2), "gib": round(size / 2**30, 2)}),
                  flush=True)
    finally:
        D.shutdown()


if __name__ == "__main__":
    main()
