#!/usr/bin/env bash
# Issue 53's rows in one device call, everything packed into OUT_DIR/long-context.tgz as it finishes (a device call
# brings back at most 8 files). Needs the peers' folder as .peers (../shared/peers copied in and carried: its README)
# for the peer rows; without it those rows are skipped.
#   paper: the paper shape (64 q heads, 4 KV, d 128) at 64k and 128k: ours, dense SDPA and mdy666 (peer_bench)
#   m7c:   m7c (12 q, 2 KV, d 64) at 16k-128k: ours, dense and mdy666; then its stages against the roofline at 64k
#   train: `nsa bench train` m7c-125m, every block NSA and dense, compiled, batch 1 at 32k, 64k and 128k
#   stages: the paper shape's stages at 64k and 128k (`nsa bench attention --stages`)
#   cp:    context parallelism over two GPUs at 262,144 tokens against one GPU at 131,072 (multigpu_rows.sh cp)
# Four or more GPUs: the first four parts side by side (GPUs 0-3), then cp on GPUs 2-3. Fewer: one after the other
# on GPU 0 in the order paper, train, m7c, stages, each given what is left of the deadline (cp on two GPUs only).
# Usage: scripts/long_context_rows.sh OUT_DIR   (env: DEADLINE 560 s from the start, PEAK_TFLOPS 750, PEAK_TBPS 4.0)
set -u
out=${1:?out dir}
deadline=${DEADLINE:-560}; tf=${PEAK_TFLOPS:-750}; tb=${PEAK_TBPS:-4.0}
work=$(mktemp -d /tmp/long-rows.XXXX); mkdir -p "$out"
t0=$(date +%s)
left() { echo $(( deadline - ($(date +%s) - t0) )); }
say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$work/progress.log"; }
pack() { tar czf "$out/long-context.tgz" -C "$work" . 2>/dev/null; }
{ git log --oneline -1; nvidia-smi -L; } > "$work/commit.txt" 2>&1
gpus=$(nvidia-smi -L | grep -c '^GPU')
peers=0; [ -f .peers/peer_bench.py ] && peers=1
export PYTHONPATH=${PYTHONPATH:-}:$PWD/.peers
A="python3 -m nsa_cli bench attention --no-peer"
# each part: its GPU, then the most seconds it may take (capped by what is left of the deadline)
cap() { local want=$1 room=$(( $(left) - 20 )); [ "$room" -lt "$want" ] && want=$room; echo $(( want > 1 ? want : 1 )); }
# peer_bench's own budget: its limit less a margin, at least 10 s
budget() { local b=$(( $1 * 4 / 5 )); echo $(( b > 10 ? b : 10 )); }
part_paper() {
  [ $peers = 1 ] || return 0
  local c; c=$(cap "$2")
  CUDA_VISIBLE_DEVICES=$1 timeout "$c" python3 .peers/peer_bench.py 65536,131072 --shapes paper \
    --peers ours,dense,mdy666 --check-len 0 --no-pieces --budget-s "$(budget "$c")" \
    --out "$work/peer-paper.json" > "$work/peer-paper.log" 2>&1
  say "paper peers rc $?"; pack
}
part_m7c() {
  if [ $peers = 1 ]; then
    local c; c=$(cap 300)
    CUDA_VISIBLE_DEVICES=$1 timeout "$c" python3 .peers/peer_bench.py 16384,32768,65536,131072 --shapes m7c \
      --peers ours,dense,mdy666 --check-len 0 --no-pieces --budget-s "$(budget "$c")" \
      --out "$work/peer-m7c.json" > "$work/peer-m7c.log" 2>&1
    say "m7c peers rc $?"; pack
  fi
  CUDA_VISIBLE_DEVICES=$1 timeout "$(cap "$2")" $A --shape m7c --seq-lens 65536 --stages --peak-tflops "$tf" \
    --peak-tbps "$tb" --json-out "$work/stages-m7c.json" > "$work/stages-m7c.log" 2>&1
  say "m7c stages rc $?"; pack
}
part_train() {
  CUDA_VISIBLE_DEVICES=$1 timeout "$(cap 330)" python3 -m nsa_cli bench train --config m7c-125m \
    --set model.dense_layers=[] --modes compiled --seq-lens 32768,65536,131072 --batch-sizes 1,1,1 \
    --set model.max_seq_len=131072 --steps 5 --warmup 2 --json-out "$work/train-long.json" > "$work/train-long.log" 2>&1
  say "train rc $?"; pack
}
part_stages() {
  CUDA_VISIBLE_DEVICES=$1 timeout "$(cap 330)" $A --shape paper --seq-lens 65536,131072 --stages --peak-tflops "$tf" \
    --peak-tbps "$tb" --json-out "$work/stages-paper.json" > "$work/stages-paper.log" 2>&1
  say "paper stages rc $?"; pack
}
if [ "$gpus" -ge 4 ]; then
  part_paper 0 "$(left)" & part_m7c 1 "$(left)" & part_train 2 & part_stages 3 & wait
else
  part_paper 0 150; part_train 0; part_m7c 0 60; part_stages 0
fi
if [ "$gpus" -ge 2 ] && [ "$(left)" -gt 150 ]; then
  dev=0,1; [ "$gpus" -ge 4 ] && dev=2,3
  CUDA_VISIBLE_DEVICES=$dev timeout $(( $(left) - 10 )) bash scripts/multigpu_rows.sh "$work/cp" cp > "$work/cp.log" 2>&1
  say "cp rc $?"
else
  say "cp skipped: $gpus GPU(s) or too little time left (two GPUs and 150 s needed)"
fi
pack
say "done"
