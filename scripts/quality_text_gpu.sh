#!/usr/bin/env bash
# Issue 24's real-text quality runs on one GPU: every arm/seed in its own process, concurrently
# (compilation is CPU-bound; the small model leaves the GPU room). Corpus: the Python standard library's
# .py files as .txt documents (byte tokenizer). Usage: scripts/quality_text_gpu.sh OUT_DIR ARM:SEED ...
# EXTRA="--set k=v ..." adds overrides to every arm (the layer's learning dynamics: nsa.window_query, nsa.kv_speed;
# the GATE_VARIANT patches of scripts/gate_variants.py are gone, and a GATE_VARIANT set is refused).
# Without ARM:SEED arguments, SWEEP="--arms ... --seeds ... --lrs ..." runs one `nsa bench quality` over all of
# them, PARALLEL runs at a time dealt over the GPUs (e.g. PARALLEL=8 on four GPUs), into OUT_DIR/sweep.json
# and its curves into OUT_DIR/sweep.png.
set -u
out=${1:?out dir}; shift
if [ -n "${GATE_VARIANT:-}" ]; then
  echo "GATE_VARIANT is gone (scripts/gate_variants.py): use EXTRA='--set nsa.window_query=... --set nsa.kv_speed=...'" >&2
  exit 2
fi
corpus=/tmp/pystd
if [ ! -d "$corpus" ]; then  # built aside and moved in whole: two of these scripts may start together
  part=$(mktemp -d /tmp/pystd.XXXXXX)
  std=$(python3 -c "import os, sysconfig; print(sysconfig.get_paths()['stdlib'])")
  find "$std" -name '*.py' -not -path '*/site-packages/*' -not -path '*/test/*' -not -path '*/tests/*' \
    -size +2k | sort | head -517 | while read -r f; do cp "$f" "$part/$(echo "$f" | tr '/' '_').txt"; done
  mv -T "$part" "$corpus" 2>/dev/null || rm -rf "$part"
fi
echo "corpus: $(ls "$corpus" | wc -l) files, $(cat "$corpus"/* | wc -c) bytes"
SETS=(--set data.source=local --set data.path=$corpus --set data.text_unit=${UNIT:-file} --set data.val_fraction=${VAL:-0.1} --set data.tokenizer=byte --set model.vocab_size=256
      --set model.dim=384 --set model.n_layers=6 --set model.n_heads=6 --set model.n_kv_groups=2
      --set model.d_k=64 --set model.d_v=64 --set model.mlp_hidden=1536 --set train.seq_len=${SEQ:-2048}
      --set train.batch_size=${BATCH:-16} --set optimizer.lr=1e-3 --set schedule.warmup_steps=100
      --set eval.batches=8 --set logging.every=100 --set data.prefetch_depth=2 ${EXTRA:-})
if [ $# -eq 0 ]; then
  python3 -m nsa_cli bench quality --config m7c-125m "${SETS[@]}" ${SWEEP:?SWEEP or ARM:SEED arguments} \
    --parallel "${PARALLEL:-1}" --steps ${STEPS:-1200} -o /tmp/quality-$$ --json-out "$out/sweep.json" --chart "$out/sweep.png" > "$out/sweep.log" 2>&1
  exit $?
fi
for spec in "$@"; do
  arm=${spec%%:*}; seed=${spec##*:}
  tag=$(printf %s "$arm" | tr -c "a-zA-Z0-9-" "_")-s$seed
  python3 -m nsa_cli bench quality --config m7c-125m "${SETS[@]}" --arms "$arm" --seeds "$seed" \
    --steps ${STEPS:-1200} -o /tmp/quality --json-out "$out/$tag.json" > "$out/$tag.log" 2>&1 &
done
wait
