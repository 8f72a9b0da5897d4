#!/usr/bin/env bash
# GPU run of the Triton NSA kernels: correctness tests, per-stage breakdown, then `nsa bench attention`.
# Usage on the device machine (repo root): bash scripts/device_kernels.sh [stage ...]
# stages: test, breakdown, attention, train (default: test breakdown attention). Logs/JSON go to $OUT.
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
    profile)
      timeout 300 python3 - <<'PY' 2>&1 | tee "$OUT/profile.log"
import torch
from torch.profiler import profile, ProfilerActivity
from nsa.bench.attention import bench_one
from nsa.ops import NSAParams
from nsa.config import load_named
from nsa.model import build_model
from nsa.ops import compress_avg, nsa_attention

def top(prof, title, n=22):
    print("=" * 20, title)
    ev = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "self_device_time_total", 0) > 0]
    ev.sort(key=lambda e: -e.self_device_time_total)
    tot = sum(e.self_device_time_total for e in ev)
    print(f"total device ms {tot/1e3:.2f}")
    for e in ev[:n]:
        print(f"{e.self_device_time_total/1e3:9.3f} ms {e.count:5d}x  {e.key[:90]}")

# 1) NSA op at paper 64k, fwd+bwd
p = NSAParams()
dev = "cuda"
S, HQ, H, D = 65536, 64, 4, 128
g = torch.Generator(device=dev).manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_(True)
q = r(1, S, HQ, D); kr, vr, ks, vs, kw, vw = (r(1, S, H, D) for _ in range(6))
gates = torch.rand(1, S, HQ, 3, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_(True)
do = torch.randn(1, S, HQ, D, generator=g, device=dev, dtype=torch.bfloat16)
def step():
    o = nsa_attention(q, compress_avg(kr, p), compress_avg(vr, p), ks, vs, kw, vw, gates, p, backend="triton")
    o.backward(do)
step(); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
top(prof, "paper 64k nsa fwd+bwd")
del q, kr, vr, ks, vs, kw, vw, gates, do
torch.cuda.empty_cache()
# 2) training step, 125M, S=2048, batch 16
cfg = load_named("m7c-125m")
cfg.runtime.attn_backend = "triton"
model = build_model(cfg).cuda().train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
ids = torch.randint(0, 256, (16, 2049), device="cuda")
def tstep():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids[:, :-1], ids[:, 1:]).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(3): tstep()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    tstep(); torch.cuda.synchronize()
top(prof, "train step m7c S=2048 B=16", 30)
PY
      ;;
    attention)
      timeout 400 python3 -m nsa_cli bench attention --shape paper --seq-lens ${SEQS:-2048,8192,16384,32768,65536} $ATTN_TUNE --json-out "$OUT/attn_paper.json" 2>&1 | tee "$OUT/attn_paper.log"
      timeout 200 python3 -m nsa_cli bench attention --shape m7c --seq-lens ${SEQS_M7C:-2048,8192,32768} $ATTN_TUNE --json-out "$OUT/attn_m7c.json" 2>&1 | tee "$OUT/attn_m7c.log" ;;
    train)
      timeout 400 python3 -m nsa_cli bench train --seq-lens ${TRAIN_SEQS:-2048,16384} --batch-sizes ${TRAIN_BS:-16,2} --json-out "$OUT/train.json" 2>&1 | tee "$OUT/train.log" ;;
  esac
done
