#!/usr/bin/env bash
# Issue 32's rows on one two-GPU machine, each pair measured in the same call (docs/benchmarks/multigpu-h200.md):
#   fsdp   125M at S=2048, one GPU against FSDP2 over two, compiled, 40 timed steps (~4 min)
#   sizes  ~1B and ~3B NSA models at 2048 x 8 and 16384 x 1, one GPU against FSDP2 over two, eager (~4 min)
#   ckpt   checkpoint save/load seconds of the trainer's code, 125M and ~1B, one process and FSDP2 (~2 min)
#   cp     125M compiled (as shipped: six dense blocks), one GPU at 65536 and 131072 against context parallelism
#          over two at 65536, 131072 and 262144, after the dense chunks' GPU test; then every block NSA, one GPU at
#          65536 against CP=2 at 131072 (~10 min)
#   train  `nsa train` as users run it (issue 54): 125M at S=2048, one GPU, DDP and FSDP2 (the whole model one unit,
#          as auto picks at 125M; a unit per block; a unit per block without resharding after the forward), 80-100
#          steps each on local text; the CSVs of the
#          log windows (~8 min; needs python -m nsa.data.corpus.packages /tmp/corpus first)
#   host   the NSA op's host-time cuts (the work list in three Triton launches, split_rotate in one launch each way)
#          on and off (`--tune sel_wl=ops --tune rot_launch=parts`): `nsa bench train` 125M at S=2048 on one GPU, DDP
#          and FSDP2 over two, and DDP and FSDP2 with CUDA graphs on two ranks (`runtime.compile_mode=reduce-overhead`)
#          (~7 min)
#   units  issue 54's next FSDP2 designs in `nsa train` (125M, S=2048, 80 steps on local text): one GPU, DDP, FSDP2 as
#          one unit, two units of six blocks (the first half's reduce-scatter under the second half's backward), the
#          reduce-scatter in bf16 (`runtime.fsdp_reduce_dtype=low`), both; and `nsa bench train` FSDP2 beside (~9 min;
#          needs python -m nsa.data.corpus.packages /tmp/corpus first)
# Usage: scripts/multigpu_rows.sh OUT_DIR fsdp|sizes|ckpt|cp|train|units|host ...   (JSON and logs into OUT_DIR)
set -u
out=${1:?out dir}; shift
mkdir -p "$out"
B="python3 -m nsa_cli bench train --attention nsa"
G1=(--set model.dim=2048 --set model.n_layers=20 --set model.n_heads=16 --set model.d_k=128 --set model.d_v=128
    --set model.mlp_hidden=5504)
G3=(--set model.dim=3072 --set model.n_layers=28 --set model.n_heads=24 --set model.d_k=128 --set model.d_v=128
    --set model.mlp_hidden=8192)
FSDP=(--nproc-per-node 2 --set runtime.parallel=fsdp)
run() { local tag=$1; shift; echo "== $tag"; "$@" > "$out/$tag.log" 2>&1; grep -E "tokens/s|out of memory|Error" "$out/$tag.log" | tail -4; }
for part in "$@"; do
  case $part in
    fsdp)
      for arm in one fsdp; do
        extra=(); [ $arm = fsdp ] && extra=("${FSDP[@]}")
        run "fsdp-125m-$arm" $B --modes compiled --seq-lens 2048 --batch-sizes 16 --steps 40 --warmup 5 "${extra[@]}" \
          --json-out "$out/fsdp-125m-$arm.json"
      done ;;
    sizes)
      for size in 1b 3b; do
        if [ $size = 1b ]; then g=("${G1[@]}"); else g=("${G3[@]}"); fi
        for arm in one fsdp; do
          extra=(); [ $arm = fsdp ] && extra=("${FSDP[@]}")
          run "size-$size-$arm" $B --modes eager --seq-lens 2048,16384 --batch-sizes 8,1 --steps 3 --warmup 1 "${g[@]}" \
            "${extra[@]}" --json-out "$out/size-$size-$arm.json"
        done
      done ;;
    ckpt)
      for g in "" "${G1[*]}"; do
        python3 scripts/ckpt_time.py --dir /tmp/ck1 $g 2>&1 | tail -1 | tee -a "$out/ckpt.jsonl"
        torchrun --nproc-per-node 2 scripts/ckpt_time.py --dir /tmp/ck2 --set runtime.parallel=fsdp $g 2>&1 | tail -1 \
          | tee -a "$out/ckpt.jsonl"
      done ;;
    cp)
      # the dense blocks' chunks on cuDNN (nsa.ops.chunk_attention) against the explicit mask first
      echo "== cp-chunk-test"; python3 -m pytest -o addopts= -q -m gpu tests/test_chunk_attention.py 2>&1 | tail -2
      run cp-one $B --modes compiled --seq-lens 65536,131072 --batch-sizes 1,1 --steps 5 --warmup 2 \
        --json-out "$out/cp-one.json"
      run cp-two $B --modes compiled --seq-lens 65536,131072 --batch-sizes 1,1 --steps 5 --warmup 2 \
        --nproc-per-node 2 --context-parallel 2 --json-out "$out/cp-two.json"
      run cp-two-256k $B --modes compiled --seq-lens 262144 --batch-sizes 1 --steps 3 --warmup 2 \
        --nproc-per-node 2 --context-parallel 2 --json-out "$out/cp-two-256k.json"
      # every block NSA (the 0.77x row): one GPU at 65536 against CP=2 at 131072
      A=(--modes compiled --batch-sizes 1 --steps 5 --warmup 2 --set model.dense_layers=[] --set model.max_seq_len=131072)
      run cp-nsa-one $B "${A[@]}" --seq-lens 65536 --json-out "$out/cp-nsa-one.json"
      run cp-nsa-two $B "${A[@]}" --seq-lens 131072 --nproc-per-node 2 --context-parallel 2 \
        --json-out "$out/cp-nsa-two.json" ;;
    train)
      T=(python3 -m nsa_cli train --config m7c-125m --seq-len 2048 --batch-size 16 --dataset local
         --data-path /tmp/corpus/text --tokenizer byte --set data.val_fraction=0.02 --set eval.every=0
         --set checkpoint.every=0 --set logging.every=10)
      for arm in one one-nographs ddp fsdp fsdp-blocks fsdp-noreshard; do
        case $arm in
          one) x=(--steps 100) ;;
          one-nographs) x=(--steps 100 --set runtime.compile_mode=default) ;;  # the two-GPU runs' compile mode
          ddp) x=(--steps 80 --nproc-per-node 2) ;;
          fsdp) x=(--steps 80 --nproc-per-node 2 --set runtime.parallel=fsdp) ;;  # 125M: one unit (auto)
          fsdp-blocks) x=(--steps 80 --nproc-per-node 2 --set runtime.parallel=fsdp --set runtime.fsdp_unit_blocks=1) ;;
          fsdp-noreshard) x=(--steps 80 --nproc-per-node 2 --set runtime.parallel=fsdp --set runtime.fsdp_unit_blocks=1
                             --set runtime.fsdp_reshard_after_forward=false) ;;
        esac
        run "train-$arm" "${T[@]}" "${x[@]}" -o "/tmp/train-$arm" && cp "/tmp/train-$arm/training.csv" "$out/train-$arm.csv"
      done ;;
    units)
      T=(python3 -m nsa_cli train --config m7c-125m --seq-len 2048 --batch-size 16 --dataset local
         --data-path /tmp/corpus/text --tokenizer byte --set data.val_fraction=0.02 --set eval.every=0
         --set checkpoint.every=0 --set logging.every=10 --steps 80)
      F=(--nproc-per-node 2 --set runtime.parallel=fsdp)
      for arm in one ddp fsdp fsdp-2units fsdp-low fsdp-2units-low; do
        case $arm in
          one) x=() ;;
          ddp) x=(--nproc-per-node 2) ;;
          fsdp) x=("${F[@]}") ;;  # 125M: the whole model one unit (auto)
          fsdp-2units) x=("${F[@]}" --set runtime.fsdp_unit_blocks=6) ;;  # the first half's reduce-scatter overlaps
          fsdp-low) x=("${F[@]}" --set runtime.fsdp_reduce_dtype=low) ;;  # the reduce-scatter in bf16
          fsdp-2units-low) x=("${F[@]}" --set runtime.fsdp_unit_blocks=6 --set runtime.fsdp_reduce_dtype=low) ;;
        esac
        run "units-$arm" "${T[@]}" "${x[@]}" -o "/tmp/units-$arm" && cp "/tmp/units-$arm/training.csv" "$out/units-$arm.csv"
      done
      run units-bench-fsdp $B --modes compiled --seq-lens 2048 --batch-sizes 16 --steps 40 --warmup 10 "${F[@]}" \
        --json-out "$out/units-bench-fsdp.json" ;;
    host)
      H=($B --modes compiled --seq-lens 2048 --batch-sizes 16 --steps 20 --warmup 5)
      OLD=(--tune sel_wl=ops --tune rot_launch=parts)
      for arm in one one-old ddp ddp-old fsdp fsdp-old ddp-graphs fsdp-graphs; do
        case $arm in
          one) x=() ;;
          one-old) x=("${OLD[@]}") ;;
          ddp) x=(--nproc-per-node 2) ;;
          ddp-old) x=(--nproc-per-node 2 "${OLD[@]}") ;;
          fsdp) x=("${FSDP[@]}") ;;
          fsdp-old) x=("${FSDP[@]}" "${OLD[@]}") ;;
          ddp-graphs) x=(--nproc-per-node 2 --set runtime.compile_mode=reduce-overhead) ;;
          fsdp-graphs) x=("${FSDP[@]}" --set runtime.compile_mode=reduce-overhead) ;;  # each block's graphs
        esac
        run "host-$arm" "${H[@]}" "${x[@]}" --json-out "$out/host-$arm.json"
      done ;;
    *) echo "unknown part $part (fsdp, sizes, ckpt, cp, train, units, host)"; exit 2 ;;
  esac
done
