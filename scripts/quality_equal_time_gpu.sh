#!/usr/bin/env bash
# Issue 52's judge: NSA recipes against dense at equal tokens and at equal GPU time, on the corpus of the installed
# packages (python -m nsa.data.corpus.packages, ~480 MB on the GPU machines: every run sees each token at most once),
# the quality model of scripts/quality_text_gpu.sh (6 layers, dim 384), byte tokens.
# Usage: scripts/quality_equal_time_gpu.sh OUT_DIR   with, in the environment:
#   ARMS (dense,nsa) SEEDS (0,1,2) LRS (1e-3; empty: the config's or the arms' own) SEQ (2048) BATCH (16) STEPS (1200) BUDGET (both) PARALLEL (6)
#   EXTRA ("--set k=v ..." for every arm) CORPUS (/tmp/corpus) WORK (the runs; /tmp/quality-PID) TIMEREF (the arm whose GPU time the others get;
#   empty: the slowest probed)
set -u
out=${1:?out dir}
lrs=${LRS-1e-3}
corpus=${CORPUS:-/tmp/corpus}
if [ ! -f "$corpus/manifest.json" ]; then
  python3 -m nsa.data.corpus.packages "$corpus" --min-mb 300 --val-fraction 0.02 | tail -1 || exit 2
fi
python3 -m nsa_cli bench quality --config m7c-125m \
  --set data.source=local --set data.path="$corpus/text" --set data.val_fraction=0.02 --set data.tokenizer=byte \
  --set model.vocab_size=256 --set model.dim=384 --set model.n_layers=6 --set model.n_heads=6 \
  --set model.n_kv_groups=2 --set model.d_k=64 --set model.d_v=64 --set model.mlp_hidden=1536 \
  --set train.seq_len="${SEQ:-2048}" --set train.batch_size="${BATCH:-16}" --set schedule.warmup_steps=100 \
  --set eval.batches=8 --set logging.every=100 --set data.prefetch_depth=2 ${EXTRA:-} \
  --arms "${ARMS:-dense,nsa}" --seeds "${SEEDS:-0,1,2}" ${lrs:+--lrs "$lrs"} --steps "${STEPS:-1200}" \
  --budget "${BUDGET:-both}" ${TIMEREF:+--time-reference "$TIMEREF"} --parallel "${PARALLEL:-6}" -o "${WORK:-/tmp/quality-$$}" \
  --json-out "$out/quality.json" --chart "$out/quality.png"
