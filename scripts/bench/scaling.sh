#!/usr/bin/env bash
# Data-parallel scaling on this machine: training samples/s of 1 and 2 processes for bpr and
# gpt2rec (cached, and dynamic with BENCH_DYNAMIC=1) on the built-in default data ("small") and
# on full-size generated data, with the ways two ranks of one host can exchange gradients:
#   sockets  dense gradients through the tcp ring over loopback (the old path)
#   shm      dense gradients through shared memory
#   shm+sparse  shared memory, embedding gradients row-sparse, every rank updating all of its
#               own copy of the tables
#   shared tables  the same, with the tables kept once in shared memory and each rank updating
#               its share of the rows (the default)
# Same global batch (256, micro 64) everywhere, OMP_NUM_THREADS=1, `checkpoint.resume = never`.
# samples/s is the trainer's own summary figure: samples trained over the wall time of training,
# the end-of-epoch validation and checkpoints included (the steps alone are a little faster).
#
# Usage: scripts/bench/scaling.sh [SIZES] [MODELS] [EPOCHS]
#   SIZES  "small full" (default) or one of them; MODELS "bpr cached" (default; add "dynamic")
set -eu
cd "$(dirname "$0")/../.."
sizes="${1:-small full}"
models="${2:-bpr cached}"
. scripts/bench/lib.sh
export OMP_NUM_THREADS=1

run() { # size model procs shm sparse shared -> samples/s
  local size=$1 model=$2 procs=$3 shm=$4 sparse=$5 shared=$6 kind=gpt2rec mode=cached epochs=${EPOCHS:-2}
  local blocks=() # only dynamic text trains GPT-2 blocks: its top one here
  case $model in bpr) kind=bpr ;; dynamic) mode=dynamic; epochs=1; blocks=(--set model.trainable_layers=1) ;; esac
  [ "$size" = full ] && epochs=1
  local name="$size-$model-p$procs-shm$shm-sparse$sparse-shared$shared"
  "$launch" --num-processes "$procs" --master-port 0 configs/default.toml \
    --set run.output_dir=\""$out"\" --set run.name=\""$name"\" \
    --set data.synthetic=\""$size"\" --set model.kind=\""$kind"\" \
    --set model.text_mode=\""$mode"\" --set train.epochs="$epochs" \
    "${blocks[@]}" --set model.max_text_tokens=32 \
    --set checkpoint.resume=\"never\" --set eval.patience=0 \
    --set batch.global=256 --set batch.micro=64 \
    --set dist.shared_memory="$shm" --set dist.sparse_embeddings="$sparse" \
    --set dist.shared_tables="$shared" \
    >"$out/$name.log" 2>&1 || { echo "$name failed: see $out/$name.log" >&2; tail -3 "$out/$name.log" >&2; exit 1; }
  summary_samples_per_s "$out/$name"
}

echo "| data | model | 1 process | 2, sockets | 2, shm | 2, shm+sparse | 2, shared tables (default) | 2 / 1 (default) |"
echo "|---|---|---|---|---|---|---|---|"
for size in $sizes; do
  for model in $models; do
    one=$(run "$size" "$model" 1 true true true)
    sock=$(run "$size" "$model" 2 false false false)
    shm=$(run "$size" "$model" 2 true false false)
    sparse=$(run "$size" "$model" 2 true true false)
    shared=$(run "$size" "$model" 2 true true true)
    ratio=$(python3 -c "print(f'{$shared / $one:.2f}x')")
    echo "| $size | $model | $one | $sock | $shm | $sparse | $shared | $ratio |"
  done
done
