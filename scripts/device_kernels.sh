#!/usr/bin/env bash
# GPU run of the Triton NSA kernels: correctness tests, per-stage breakdown, then `nsa bench attention`.
# Usage on the device machine (repo root): bash scripts/device_kernels.sh [stage ...]
# stages: test, breakdown, sweep, profile, attention, train (default: test breakdown attention). Logs/JSON go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-test breakdown attention}
ATTN_TUNE=${ATTN_TUNE:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
for st in $stages; do
  case $st in
    test)
      timeout 550 python3 -m pytest tests/test_triton_kernels.py tests/test_ops_offset.py -x -q -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/test.log" ;;
    breakdown)
      timeout 300 python3 - <<'PY' 2>&1 | tee "$OUT/breakdown.log"
import json, os, torch
from nsa.bench.attention import kernel_breakdown
res = {}
for name, S, HQ, H, D in [("paper", 16384, 64, 4, 128), ("paper", 65536, 64, 4, 128), ("m7c", 32768, 12, 2, 64)]:
    r = kernel_breakdown(S, HQ, H, D)
    res[f"{name}-{S}"] = r
    print(name, S, " ".join(f"{k}={v:.3f}" for k, v in r.items()), "total", f"{sum(r.values()):.2f}", flush=True)
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "breakdown.json"), "w"), indent=1)
PY
      ;;
    sweep)
      timeout 300 python3 - <<'PY' 2>&1 | tee "$OUT/sweep.log"
import torch
from nsa.bench.attention import kernel_breakdown
variants = [
    ("base", {}, None),
    ("sel_bm16", {"sel_bm": 16}, ("sel_fwd", "sel_bwd")),
    ("sel_bm32", {"sel_bm": 32}, ("sel_fwd", "sel_bwd")),
]
for shape, S, HQ, H, D in [("paper", 65536, 64, 4, 128), ("m7c", 32768, 12, 2, 64), ("m7c", 2048, 12, 2, 64)]:
    for name, tune, only in (variants if S > 2048 else variants[:1]):
        try:
            r = kernel_breakdown(S, HQ, H, D, only=only, tune=tune)
            print(shape, S, name, " ".join(f"{k}={v:.3f}" for k, v in r.items()), flush=True)
        except Exception as exc:
            print(shape, S, name, "FAILED", type(exc).__name__, str(exc)[:300], flush=True)
        torch.cuda.empty_cache()
PY
      ;;
    profile)  # kernels by device time (nsa.bench.profile): the op at paper 64k, then a training step of m7c-125m
      timeout 300 python3 -m nsa_cli bench attention --shape paper --seq-lens 65536 --no-dense --no-peer \
        --profile-step --json-out "$OUT/profile_op.json" 2>&1 | tee "$OUT/profile.log"
      timeout 400 python3 -m nsa_cli bench train --config m7c-125m --seq-lens 2048 --batch-sizes 16 --attention nsa \
        --modes eager --profile-step --json-out "$OUT/profile_train.json" 2>&1 | tee -a "$OUT/profile.log" ;;
    attention)
      timeout 400 python3 -m nsa_cli bench attention --shape paper --seq-lens ${SEQS:-2048,8192,16384,32768,65536} $ATTN_TUNE --json-out "$OUT/attn_paper.json" 2>&1 | tee "$OUT/attn_paper.log"
      timeout 200 python3 -m nsa_cli bench attention --shape m7c --seq-lens ${SEQS_M7C:-2048,8192,32768} $ATTN_TUNE --json-out "$OUT/attn_m7c.json" 2>&1 | tee "$OUT/attn_m7c.log" ;;
    train)
      timeout 400 python3 -m nsa_cli bench train --seq-lens ${TRAIN_SEQS:-2048,16384} --batch-sizes ${TRAIN_BS:-16,2} --json-out "$OUT/train.json" 2>&1 | tee "$OUT/train.log" ;;
  esac
done
