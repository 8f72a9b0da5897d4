#!/usr/bin/env bash
# Issue 53's rows in one call of a 4x H200 (or H100) host, everything packed into OUT_DIR/long-context.tgz as it
# finishes (a device call brings back at most 8 files). Needs the peers' folder as .peers (../shared/peers copied in
# and carried: its README) for the peer rows; without it those rows are skipped.
#   GPU 0: the paper shape (64 q heads, 4 KV, d 128) at 64k and 128k: ours, dense SDPA and mdy666 (peer_bench)
#   GPU 1: m7c (12 q, 2 KV, d 64) at 16k-128k: ours, dense and mdy666; then its stages against the roofline at 64k
#   GPU 2: `nsa bench train` m7c-125m, every block NSA and dense, compiled, batch 1 at 32k, 64k and 128k
#   GPU 3: the paper shape's stages at 64k and 128k (`nsa bench attention --stages`), then the op's peak memory rows
#   then GPUs 2-3: context parallelism over two at 262,144 tokens against one GPU at 131,072 (multigpu_rows.sh cp)
# Usage: scripts/long_context_rows.sh OUT_DIR   (env: DEADLINE 560 s from the start, PEAK_TFLOPS 750, PEAK_TBPS 4.0)
set -u
out=${1:?out dir}
deadline=${DEADLINE:-560}; tf=${PEAK_TFLOPS:-750}; tb=${PEAK_TBPS:-4.0}
work=$(mktemp -d /tmp/long-rows.XXXX); mkdir -p "$out"
t0=$(date +%s)
left() { echo $(( deadline - ($(date +%s) - t0) )); }
say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$work/progress.log"; }
pack() { tar czf "$out/long-context.tgz" -C "$work" . 2>/dev/null; }
peers=0; [ -f .peers/peer_bench.py ] && peers=1
export PYTHONPATH=${PYTHONPATH:-}:$PWD/.peers
A="python3 -m nsa_cli bench attention --no-peer"
(
  export CUDA_VISIBLE_DEVICES=0
  [ $peers = 1 ] && timeout $(( $(left) - 20 )) python3 .peers/peer_bench.py 65536,131072 --shapes paper \
    --peers ours,dense,mdy666 --check-len 0 --no-pieces --budget-s $(( $(left) - 60 )) --out "$work/peer-paper.json" \
    > "$work/peer-paper.log" 2>&1
  say "gpu0 paper peers rc $?"; pack
) &
(
  export CUDA_VISIBLE_DEVICES=1
  [ $peers = 1 ] && timeout 300 python3 .peers/peer_bench.py 16384,32768,65536,131072 --shapes m7c \
    --peers ours,dense,mdy666 --check-len 0 --no-pieces --budget-s 240 --out "$work/peer-m7c.json" \
    > "$work/peer-m7c.log" 2>&1
  say "gpu1 m7c peers rc $?"; pack
  timeout $(( $(left) - 20 )) $A --shape m7c --seq-lens 65536 --stages --peak-tflops "$tf" --peak-tbps "$tb" \
    --json-out "$work/stages-m7c.json" > "$work/stages-m7c.log" 2>&1
  say "gpu1 m7c stages rc $?"; pack
) &
(
  export CUDA_VISIBLE_DEVICES=2
  timeout 330 python3 -m nsa_cli bench train --config m7c-125m --set model.dense_layers=[] --modes compiled \
    --seq-lens 32768,65536,131072 --batch-sizes 1,1,1 --set model.max_seq_len=131072 --steps 5 --warmup 2 \
    --json-out "$work/train-long.json" > "$work/train-long.log" 2>&1
  say "gpu2 train rc $?"; pack
) &
(
  export CUDA_VISIBLE_DEVICES=3
  timeout 330 $A --shape paper --seq-lens 65536,131072 --stages --peak-tflops "$tf" --peak-tbps "$tb" \
    --json-out "$work/stages-paper.json" > "$work/stages-paper.log" 2>&1
  say "gpu3 paper stages rc $?"; pack
) &
wait
if [ "$(left)" -gt 150 ]; then
  CUDA_VISIBLE_DEVICES=2,3 timeout $(( $(left) - 10 )) bash scripts/multigpu_rows.sh "$work/cp" cp > "$work/cp.log" 2>&1
  say "cp rc $?"
fi
pack
say "done"
