#!/usr/bin/env bash
# Several quality sweeps in one call, one per GPU, side by side (scripts/quality_text_gpu.sh each, its own
# SEQ, BATCH and PARALLEL): e.g. 32k arms three to a GPU beside 2k arms six to another.
# Usage: scripts/quality_side_by_side.sh OUT NAME@SEQ@BATCH@PARALLEL@ARMS ...   (the i-th sweep on GPU i)
# Each sweep writes OUT/NAME/sweep.{json,json.rows.jsonl,log,png}; SEEDS (default 0,1,2), LIMIT (seconds a
# sweep may run, default 540: a cut sweep keeps its finished rows) and, with PACK=1, everything packed into
# OUT/sweeps.tgz (for a machine that returns a few files per call). The arms of each sweep's table and its
# per-seed rows are printed at the end.
set -u
out=${1:?out dir}; shift
i=0
for spec in "$@"; do
  IFS=@ read -r name seq batch par arms <<< "$spec"
  mkdir -p "$out/$name"
  CUDA_VISIBLE_DEVICES=$i SEQ=$seq BATCH=$batch SWEEP="--arms $arms --seeds ${SEEDS:-0,1,2}" PARALLEL=$par \
    timeout "${LIMIT:-540}" bash "$(dirname "$0")/quality_text_gpu.sh" "$out/$name" &
  i=$((i + 1)); sleep 2
done
wait
for spec in "$@"; do
  name=${spec%%@*}; echo "== $name"
  grep -v "^\s*$" "$out/$name/sweep.log" | grep -A8 "arms over their seeds"
  grep -E "^│ +[^ ]+ │ +[0-9] │" "$out/$name/sweep.log"
done
if [ "${PACK:-0}" = 1 ]; then
  tar czf "$out.tgz" -C "$out" . && mv "$out.tgz" "$out/sweeps.tgz"
fi
