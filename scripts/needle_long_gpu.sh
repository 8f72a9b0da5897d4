#!/usr/bin/env bash
# Issue 33's needle rows with the default recipe: runbooks/needle-retrieval.md's length curriculum
# 256 -> 1k -> 4k -> 16k, continued to 32k, each arm on a GPU of its own (arm i on GPU i mod the count), all
# arms at once; then `nsa eval --task needle` by depth at 4k, 16k and 32k.
# Usage: scripts/needle_long_gpu.sh OUT_DIR [ARM ...]   arms: nsa (the default recipe), nsa-kl (with the scorer
# loss), dense, window
# EXTRA="--set k=v ..." adds overrides to every stage; SAMPLES (32) needles per cell; LONG_X (1) multiplies the
# steps of the 16k and 32k stages; GPUS ("0 1": all) the GPUs the arms take in turn. An arm may name its seed,
# ARM:SEED (default 1337, the config's): `nsa:1 nsa:2 dense:1 dense:2` trains four models at once.
set -u
out=${1:?out dir}; shift
mkdir -p "$out"
arms=("$@"); [ ${#arms[@]} -eq 0 ] && arms=(nsa dense)
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$ngpu" -gt 0 ] || { echo "no GPU"; exit 2; }
read -r -a gpus <<< "${GPUS:-$(seq -s ' ' 0 $((ngpu - 1)))}"  # GPUS="1": only these
# seq_len batch steps lr, per stage
X=${LONG_X:-1}
STAGES=("256 64 800 1e-3" "1024 16 800 1e-3" "4096 4 800 3e-4" "16384 2 $((600 * X)) 1e-4" "32768 1 $((400 * X)) 1e-4")
run_arm() {
  local arm=${1%%:*} seed=${1#*:} gpu=$2 prev="" extra=() tag=$1
  [ "$seed" = "$1" ] && { seed=1337; tag=$arm; } || tag=$arm-seed$seed
  case $arm in
    nsa) ;;
    nsa-kl) extra=(--set scorer.weight=0.1) ;;
    dense) extra=(--set model.attention=dense) ;;
    window) extra=(--set 'nsa.fixed_gates=[0,0,1]') ;;
    *) echo "unknown arm $arm (nsa, nsa-kl, dense, window)"; return 2 ;;
  esac
  for st in "${STAGES[@]}"; do
    read -r S B N LR <<< "$st"
    local dir=/tmp/needle-long/$tag-s$S init=()
    [ -n "$prev" ] && init=(--set "train.init_from=$prev" --set schedule.warmup_steps=20)
    CUDA_VISIBLE_DEVICES=$gpu python3 -m nsa_cli train --config needle --steps "$N" --seq-len "$S" --batch-size "$B" \
      --set "optimizer.lr=$LR" --set "train.seed=$seed" --set model.max_seq_len=32768 --set checkpoint.every=0 "${init[@]}" "${extra[@]}" \
      ${EXTRA:-} --out-dir "$dir" > "$out/$tag-s$S.log" 2>&1 || { echo "$tag: stage $S failed"; tail -3 "$out/$tag-s$S.log"; return 1; }
    prev=$dir
  done
  CUDA_VISIBLE_DEVICES=$gpu python3 -m nsa_cli eval "$prev" --task needle --contexts 4096,16384,32768 \
    --depths 0,0.25,0.5,0.75,1 --samples "${SAMPLES:-32}" --json-out "$out/eval-$tag.json" > "$out/eval-$tag.log" 2>&1
  echo "== $tag"; tail -12 "$out/eval-$tag.log"
}
i=0
for arm in "${arms[@]}"; do run_arm "$arm" "${gpus[$((i % ${#gpus[@]}))]}" & i=$((i + 1)); done
wait
