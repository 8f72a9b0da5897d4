#!/usr/bin/env bash
# Issue 55's 125M evidence, one seed per call on a 4-GPU machine (docs/benchmarks/quality-125m.md):
#   GPUs 0-2: m7c-125m (byte tokens) at S=8192, STEPS steps of 32,768 tokens, `nsa bench quality` arms
#             dense-curriculum (dense at its best: a quarter of the steps at 2k), nsa (the shipped hybrid) and
#             dense-wide (dense-curriculum widened to the hybrid's parameter count: mlp_hidden 3328)
#   GPU 3:    dense-time: dense-curriculum for TIME_STEPS steps (the hybrid's GPU time at its measured step ratio)
#   then each model LONG_STEPS steps more at S=32768 (batch 1, from its weights) and `nsa eval --task ruler` at
#   4k-32k and the needle grid at 32k on the result. Everything is written to OUT_DIR as it finishes; the
#   call's deadline (DEADLINE seconds from the start) stops what is still running.
# Usage: SEED=0 scripts/quality_125m_gpu.sh OUT_DIR   (env: STEPS 1400, TIME_STEPS 1577, LONG_STEPS 160,
#        LR 6e-4, DEADLINE 570, CORPUS /tmp/corpus, WORK /tmp/q125; ARMS and GPUS: the equal-token arms and their
#        GPUs (default the three above on 0,1,2); TIME_ARM (empty: none) on TIME_GPU 3; LONG: the arms continued
#        at 32k (default all))
set -u
out=${1:?out dir}
seed=${SEED:-0}; steps=${STEPS:-1400}; tsteps=${TIME_STEPS:-1577}; long=${LONG_STEPS:-160}; lr=${LR:-6e-4}
corpus=${CORPUS:-/tmp/corpus}; work=${WORK:-/tmp/q125}; deadline=${DEADLINE:-570}
t0=$(date +%s)
left() { echo $(( deadline - ($(date +%s) - t0) )); }
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
mkdir -p "$out" "$work"
if [ ! -f "$corpus/manifest.json" ]; then
  python3 -m nsa.data.corpus.packages "$corpus" --min-mb 300 --max-mb 320 --val-fraction 0.02 | tail -1 || exit 2
fi
cp "$corpus/manifest.json" "$out/corpus-manifest.json"
Q="python3 -m nsa_cli bench quality --config m7c-125m --set data.source=local --set data.path=$corpus/text
   --set data.val_fraction=0.02 --set data.tokenizer=byte --set train.seq_len=8192 --set train.batch_size=4
   --set optimizer.lr=$lr --set schedule.warmup_steps=150 --set eval.batches=8 --set logging.every=50
   --set data.prefetch_depth=2 --seeds $seed"
arms=${ARMS-dense-curriculum,nsa,dense-wide=dense-curriculum;model.mlp_hidden=3328}; gpus=${GPUS:-0,1,2}
time_arm=${TIME_ARM-dense-time=dense-curriculum}
n_arms=$(echo "$arms" | tr ',' '\n' | grep -c .)
say "training: $steps steps ($arms on $gpus; $time_arm $tsteps steps)"
CUDA_VISIBLE_DEVICES=$gpus timeout $(left) $Q --arms "$arms" --steps "$steps" --parallel "$n_arms" -o "$work/tok" \
  --json-out "$out/q125-tokens-s$seed.json" > "$work/tok.log" 2>&1 &
if [ -n "$time_arm" ]; then
  CUDA_VISIBLE_DEVICES=${TIME_GPU:-3} timeout $(left) $Q --arms "$time_arm" --steps "$tsteps" --parallel 1 \
    -o "$work/time" --json-out "$out/q125-time-s$seed.json" > "$work/time.log" 2>&1 &
fi
wait
say "trained"; tail -n 3 "$work"/*.log
long_gpus=(${LONG_GPUS:-0 1 2 3}); i=0
for run in "$work"/tok/*/"seed$seed" "$work"/time/*/"seed$seed"; do
  [ -d "$run" ] || continue
  name=$(basename "$(dirname "$run")")
  case ",${LONG-$name}," in *",$name,"*) ;; *) continue ;; esac
  gpu=${long_gpus[$((i % ${#long_gpus[@]}))]}; i=$((i + 1))
  (
    export CUDA_VISIBLE_DEVICES=$gpu
    long_dir="$work/long-$name"
    timeout $(left) python3 -m nsa_cli train --config "$run/config.yaml" --set train.init_from="$run" \
      --seq-len 32768 --batch-size 1 --steps "$long" --set schedule.warmup_steps=20 --set optimizer.lr=3e-4 \
      --set checkpoint.every=0 --set eval.every=0 --set train.resume=null --set train.stop_at=null \
      --set train.run_name="$name-32k-seed$seed" -o "$long_dir" > "$work/long-$name.log" 2>&1
    say "$name: 32k phase rc $?"
    timeout $(left) python3 -m nsa_cli eval "$long_dir" --task ruler --contexts 4096,8192,16384,32768 \
      --json-out "$work/ruler-$name.json" > "$work/ruler-$name.log" 2>&1
    say "$name: ruler rc $?"
    timeout $(left) python3 -m nsa_cli eval "$long_dir" --task needle --contexts 32768 --samples 16 \
      --json-out "$work/needle-$name.json" > "$work/needle-$name.log" 2>&1
    say "$name: needle rc $?"
  ) &
done
wait
python3 - "$work" "$out/long-s$seed.json" <<'PY'
import json, pathlib, sys
work, dest = pathlib.Path(sys.argv[1]), sys.argv[2]
res = {}
for f in sorted(work.glob("*-*.json")):
    kind, _, name = f.stem.partition("-")
    res.setdefault(name, {})[kind] = json.loads(f.read_text())
for log in sorted(work.glob("long-*.log")):
    res.setdefault(log.stem[5:], {})["train_log_tail"] = log.read_text()[-1500:]
json.dump(res, open(dest, "w"), indent=1)
PY
tar czf "$out/logs-s$seed.tgz" -C "$work" --exclude='*/checkpoints/*' --exclude='*.pt' --exclude='*.safetensors' \
  tok.log time.log $(cd "$work" && ls -d long-*.log ruler-*.log needle-*.log 2>/dev/null) 2>/dev/null
say "done"
