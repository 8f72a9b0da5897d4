"""Tile/loop-order sweep of the Triton NSA stages on a CUDA machine (`nsa.bench.attention.kernel_breakdown`).

Usage (repo root, GPU): python3 scripts/kernel_sweep.py [group ...]   groups: base sel seldq cmpcopy o3 range win score
Each line: shape, S, variant, then the median ms of the stages it touches; JSON lines go to $OUT/sweep.jsonl.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch

from nsa.bench.attention import kernel_breakdown
from nsa.bench.requests import SHAPES

RUNS = [("paper", 65536), ("paper", 16384), ("m7c", 32768)]
MORE_RUNS = [("paper", 8192), ("m7c", 8192), ("m7c", 16384), ("m7c", 65536)]  # only when SWEEP_RUNS names them


def variants(group: str, shape: str) -> list[tuple[str, dict, tuple[str, ...] | None]]:
    out: list[tuple[str, dict, tuple[str, ...] | None]] = []
    if group == "base":
        out.append(("base", {}, None))
    if group == "sel":
        fb = ("sel_fwd", "sel_bwd")
        for mode in ("row", "fsa"):
            out.append((f"{mode}", {"sel_mode": mode}, fb))
        for w, st, tma in itertools.product((1, 2, 4), (2, 3), (0, 1)):
            out.append((f"row-fwd-w{w}-s{st}-tma{tma}", {"sel_mode": "row", "sel_warps": w, "sel_stages": st,
                                                          "sel_tma": tma}, ("sel_fwd",)))
        for w, st in itertools.product((1, 2, 4), (2, 3)):
            out.append((f"row-dq-w{w}-s{st}", {"sel_mode": "row", "seldq_warps": w, "seldq_stages": st}, ("sel_bwd",)))
        for bm, w in itertools.product((64, 128), (4, 8)):
            out.append((f"fsa-fwd-bm{bm}-w{w}", {"sel_mode": "fsa", "sel_bm": bm, "sel_warps": w}, ("sel_fwd",)))
            out.append((f"dkdv-bm{bm}-w{w}", {"seldkdv_bm": bm, "seldkdv_warps": w}, ("sel_bwd",)))
        for ch in (256, 512, 2048):
            out.append((f"ch{ch}", {"sel_ch": ch}, fb))
    if group == "seldq":  # the selected backward: how dq is formed, the backward list's chunks, dk/dv tiles
        out.append(("bwd-default", {}, ("sel_bwd",)))
        for how in ("row", "part", "atomic"):
            out.append((f"dq-{how}", {"sel_dq": how}, ("sel_bwd",)))
        for w, st in itertools.product((4, 8), (2, 3)):  # dq fused into the dk/dv tiles: more registers
            out.append((f"dq-atomic-w{w}-s{st}", {"sel_dq": "atomic", "seldkdv_warps": w, "seldkdv_stages": st},
                        ("sel_bwd",)))
        for ch in (2048, 8192):
            out.append((f"bwd-ch{ch}", {"selbwd_ch": ch}, ("sel_bwd",)))
        for st in (2, 3, 4):
            out.append((f"dkdv-s{st}", {"seldkdv_stages": st}, ("sel_bwd",)))
    if group == "cmpcopy":  # the compressed branch's layout copies: PyTorch's strided copy or one Triton pass
        for how in ("torch", "triton"):
            out.append((f"copy-{how}", {"cmp_copy": how}, ("cmp_fwd", "cmp_bwd")))
    if group == "o3":  # the compressed output in o3's rows (3 slots) or only in the library's virtual layout
        for slots in (3, 2):
            out.append((f"o3-slots{slots}", {"o3_slots": slots}, ("cmp_fwd", "cmp_bwd", "win_fwd", "win_bwd")))
    if group in ("range", "win"):  # win: the window branch's kernels alone
        branches = ("win",) if group == "win" else ("cmp", "win")
        for br, stage in ((b, f"{b}_fwd") for b in branches):
            for bm, bn, w, st in ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
                                  (64, 128, 4, 2), (128, 64, 4, 2)):
                out.append((f"{br}-bm{bm}-bn{bn}-w{w}-s{st}",
                            {f"{br}_bm": bm, f"{br}_bn": bn, f"{br}_warps": w, f"{br}_stages": st}, (stage,)))
        for br, stage in ((b, f"{b}_bwd") for b in branches):
            for role in ("dq", "dkdv"):
                for bm, bn, w, st in ((64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2),
                                      (128, 64, 8, 1), (64, 64, 4, 1), (128, 32, 4, 2), (64, 128, 8, 2)):
                    k = f"{br}{role}"
                    out.append((f"{k}-bm{bm}-bn{bn}-w{w}-s{st}",
                                {f"{k}_bm": bm, f"{k}_bn": bn, f"{k}_warps": w, f"{k}_stages": st}, (stage,)))
    if group == "score":
        for bm, w in itertools.product((64, 128), (4, 8)):
            out.append((f"score-bm{bm}-w{w}", {"score_bm": bm, "score_warps": w}, ("select",)))
    return out


def main() -> None:
    groups = sys.argv[1:] or ["base"]
    want = [w for w in os.environ.get("SWEEP_RUNS", "").split(",") if w]
    runs = [r for r in RUNS + MORE_RUNS if f"{r[0]}-{r[1]}" in want] if want else RUNS
    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "sweep.jsonl"), "a") as log:
        _sweep(runs, groups, log)


def _sweep(runs: list[tuple[str, int]], groups: list[str], log) -> None:  # type: ignore[no-untyped-def]
    for shape, S in runs:
        HQ, H, D = SHAPES[shape]
        for group in groups:
            for name, tune, only in variants(group, shape):
                t0 = time.time()
                try:
                    r = kernel_breakdown(S, HQ, H, D, only=only, tune=tune)
                    msg = " ".join(f"{k}={v:.3f}" for k, v in r.items())
                    if only is None:
                        msg += f" total={sum(r.values()):.2f}"
                except Exception as exc:  # a variant that does not compile must not stop the sweep
                    r = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    msg = "FAILED " + r["error"]
                print(f"{shape} {S} {name:32s} {msg}  ({time.time() - t0:.0f}s)", flush=True)
                log.write(json.dumps({"shape": shape, "S": S, "variant": name, "tune": tune, **r}) + "\n")
                log.flush()
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
