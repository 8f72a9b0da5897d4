#!/usr/bin/env bash
# Issue 55 at the tokens it asks for: one 125M arm per call, data parallel over every GPU of the machine, as a user
# runs `nsa train` (docs/benchmarks/quality-125m.md). 300 M tokens over 4x H200 at one 8k sequence per GPU a step
# (the bracketed runs' 32,768 tokens) are expected to take 6-8 minutes (not measured yet): a call holds one arm.
#   ARM dense: dense with the length curriculum (a quarter of the steps at 2k, four times the sequences, then 8k)
#   ARM nsa:   the shipped hybrid at 8k;   ARM dense-wide: dense's curriculum with mlp_hidden 3328 (the hybrid's
#   parameter count). Then `nsa eval` loss by window (512, 2k, 8k) and selection on held-out text, optionally LONG_STEPS
#   at 32k and the RULER-style suite; everything lands in OUT_DIR/<arm>-s<seed>.tgz (one file: a device call brings
#   back at most 8), packed again after each phase so a call cut short keeps what finished.
# Usage: ARM=nsa SEED=0 scripts/quality_125m_ddp_gpu.sh OUT_DIR   (env: TOKENS_M 300, LR (dense 6e-4, nsa 3e-4:
#        issue 55's first stop, bracketed at 32,768 tokens a step), NPROC (the GPUs), BATCH per GPU (default: TOKENS_STEP
#        32768 over the GPUs, at least 1), LONG_STEPS 0, CORPUS /tmp/corpus, WORK /tmp/q125d;
#        BASE m7c-125m and SEQ 8192 (a CPU dry run: BASE=tiny SEQ=256 NPROC=2 TOKENS_M=0.05))
set -u
out=${1:?out dir}
arm=${ARM:?ARM=dense|nsa|dense-wide}; seed=${SEED:-0}; tokens_m=${TOKENS_M:-300}
nproc=${NPROC:-$(nvidia-smi -L | wc -l)}; long=${LONG_STEPS:-0}; config=${BASE:-m7c-125m}; seq=${SEQ:-8192}
# the step of the runs whose rates were bracketed (32,768 tokens), whatever the number of GPUs: the rates stay valid
batch=${BATCH:-$(( ${TOKENS_STEP:-32768} / (nproc * seq) > 0 ? ${TOKENS_STEP:-32768} / (nproc * seq) : 1 ))}
corpus=${CORPUS:-/tmp/corpus}; work=${WORK:-/tmp/q125d}
case $arm in
  dense) lr=${LR:-6e-4}; sets=(--attention dense); warm=1 ;;
  dense-wide) lr=${LR:-6e-4}; sets=(--attention dense --set model.mlp_hidden=3328); warm=1 ;;
  nsa) lr=${LR:-3e-4}; sets=(--attention nsa); warm=0 ;;
  *) echo "unknown ARM $arm (dense, nsa, dense-wide)"; exit 2 ;;
esac
per_step=$((nproc * batch * seq))
steps=$(python3 -c "print(max(4, round($tokens_m * 1e6 / $per_step)))")
run="$work/$arm-s$seed"; dest="$work/result-$arm-s$seed"
mkdir -p "$dest" "$work" "$out"
pack() { tar czf "$out/$arm-s$seed.tgz" -C "$work" "result-$arm-s$seed"; }
if [ ! -f "$corpus/manifest.json" ]; then
  python3 -m nsa.data.corpus.packages "$corpus" --min-mb 300 --max-mb 320 --val-fraction 0.02 | tail -1 || exit 2
fi
T=(python3 -m nsa_cli train --config "$config" --nproc-per-node "$nproc" --dataset local --data-path "$corpus/text"
   --tokenizer byte --set data.val_fraction=0.02 --steps "$steps" --lr "$lr" --seed "$seed" --set schedule.warmup_steps=150
   --set eval.every=0 --set checkpoint.every=0 --set logging.every=25 "${sets[@]}" -o "$run")
echo "$arm seed $seed: $steps steps of $per_step tokens on $nproc GPUs, lr $lr"
rm -rf "$run"
if [ "$warm" = 1 ]; then
  "${T[@]}" --seq-len $((seq / 4)) --batch-size $((batch * 4)) --stop-at $((steps / 4)) > "$dest/train-warm.log" 2>&1 || { pack; exit 1; }
  "${T[@]}" --seq-len "$seq" --batch-size "$batch" --resume auto > "$dest/train.log" 2>&1 || { pack; exit 1; }
else
  "${T[@]}" --seq-len "$seq" --batch-size "$batch" > "$dest/train.log" 2>&1 || { pack; exit 1; }
fi
cp "$run/training.csv" "$run/metrics.json" "$dest/"; pack
python3 -m nsa_cli eval "$run" --task loss --contexts $((seq / 16)),$((seq / 4)),$seq --samples 32 --json-out "$dest/loss.json" \
  > "$dest/eval.log" 2>&1
[ "$arm" = nsa ] && python3 -m nsa_cli eval "$run" --task selection --contexts "$seq" --json-out "$dest/selection.json" \
  >> "$dest/eval.log" 2>&1
pack
if [ "$long" -gt 0 ]; then
  python3 -m nsa_cli train --config "$run/config.yaml" --nproc-per-node "$nproc" --set train.init_from="$run" \
    --seq-len 32768 --batch-size 1 --steps "$long" --set schedule.warmup_steps=20 --set optimizer.lr=3e-4 \
    --set checkpoint.every=0 --set eval.every=0 --set train.resume=null --set train.stop_at=null \
    -o "$run-32k" > "$dest/train-32k.log" 2>&1 &&
  python3 -m nsa_cli eval "$run-32k" --task ruler --contexts 4096,8192,16384,32768 --json-out "$dest/ruler.json" \
    > "$dest/ruler.log" 2>&1
  python3 -m nsa_cli eval "$run-32k" --task needle --contexts 32768 --samples 16 --json-out "$dest/needle.json" \
    > "$dest/needle.log" 2>&1
  [ "$arm" = nsa ] && python3 -m nsa_cli eval "$run-32k" --task selection --contexts 32768 \
    --json-out "$dest/selection-32k.json" >> "$dest/eval.log" 2>&1  # issue 55's recall row at 32k
fi
pack
echo "done: $out/$arm-s$seed.tgz"
