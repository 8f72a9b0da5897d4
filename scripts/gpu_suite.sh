#!/usr/bin/env bash
# The whole GPU suite in one device call, for docs/benchmarks/gpu-validation.md (issue 57):
#   two or more GPUs: GPU 0 tests/test_triton_kernels.py beside GPU 1 every other single-GPU test, then GPUs 0-1
#   the multi-GPU tests; one GPU: the two single-GPU shards one after the other (the multi-GPU tests need two).
# Logs and the commit packed into OUT_DIR/gpu-suite.tgz (a device call returns at most 8 files).
# Usage: scripts/gpu_suite.sh OUT_DIR   (env: LIMIT seconds per shard, 300; LIMIT_A for the kernel shard)
set -u
out=${1:?out dir}; limit=${LIMIT:-300}; limit_a=${LIMIT_A:-$limit}
work=$(mktemp -d /tmp/gpu-suite.XXXX); mkdir -p "$out"
P=(python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE)
{ git log --oneline -1; git status --short; nvidia-smi -L
  python3 -c "import torch, triton, typer; print(torch.__version__, triton.__version__, typer.__version__)"; } \
  > "$work/commit.txt" 2>&1
gpus=$(nvidia-smi -L | grep -c '^GPU')
shard_a() { CUDA_VISIBLE_DEVICES=$1 timeout "$limit_a" "${P[@]}" -m gpu tests/test_triton_kernels.py > "$work/gpu-a.log" 2>&1; }
shard_b() { CUDA_VISIBLE_DEVICES=$1 timeout "$limit" "${P[@]}" -m "gpu and not multigpu" tests \
  --ignore tests/test_triton_kernels.py > "$work/gpu-b.log" 2>&1; }
if [ "$gpus" -ge 2 ]; then
  shard_a 0 & shard_b 1 & wait
  CUDA_VISIBLE_DEVICES=0,1 timeout "$limit" "${P[@]}" -m multigpu tests/test_multigpu.py > "$work/gpu-multi.log" 2>&1
else
  shard_a 0; shard_b 0
  echo "skipped: $gpus GPU on this machine (the multi-GPU tests need two)" > "$work/gpu-multi.log"
fi
for f in gpu-a gpu-b gpu-multi; do echo "$f: $(tail -1 "$work/$f.log")"; done | tee "$work/summary.txt"
tar czf "$out/gpu-suite.tgz" -C "$work" .
