#!/usr/bin/env bash
# Data-parallel scaling on this machine: training samples/s of 1 and 2 processes for bpr and
# gpt2rec (cached, and dynamic with BENCH_DYNAMIC=1) on the built-in default data ("small") and
# on full-size generated data, with the ways two ranks of one host can exchange gradients:
#   sockets  dense gradients through the tcp ring over loopback (the old path)
#   shm      dense gradients through shared memory
#   shm+sparse  shared memory, embedding gradients row-sparse, every rank updating all of its
#               own copy of the tables
#   shared tables  the same, with the tables kept once in shared memory and each rank updating
#               its share of the rows
#   sharded     every parameter, its moments and every rank's gradients in shared memory, each
#               rank reducing, clipping and updating its share of the rows, no gradient
#               all-reduce (`dist.shard_optimizer`, ZeRO stage 1 on one host; the default)
# Same global batch (256, micro 64) everywhere, OMP_NUM_THREADS=1, `checkpoint.resume = never`.
# samples/s is the trainer's own summary figure: samples trained over the wall time of training,
# the end-of-epoch validation and checkpoints included; "steps" is samples over the epochs' own
# time (`seconds_per_epoch`, the training steps alone). This machine's speed moves by 10-15%
# from minute to minute, so every configuration runs REPEAT times (default 3), the runs of one
# row interleaved (1 process, then each 2-process way, then again), and each cell is the median.
#
# Usage: [REPEAT=3] [WAYS="0 5"] scripts/bench/scaling.sh [SIZES] [MODELS]
#   WAYS   which columns to run, by index (0 = 1 process ... 5 = sharded; default all): the
#          others print "-" (the long dynamic runs need only the first and the default)
#   SIZES  "small full" (default) or one of them; MODELS "bpr cached" (default; add "dynamic")
# Steps per epoch times the global batch (256) are an epoch's samples: the last partial batch
# is dropped.
set -eu
cd "$(dirname "$0")/../.."
sizes="${1:-small full}"
models="${2:-bpr cached}"
. scripts/bench/lib.sh
export OMP_NUM_THREADS=1

run() { # size model procs shm sparse shared shard repeat -> the run directory
  local size=$1 model=$2 procs=$3 shm=$4 sparse=$5 shared=$6 shard=$7 again=$8 kind=gpt2rec mode=cached epochs=${EPOCHS:-2}
  local blocks=() # only dynamic text trains GPT-2 blocks: its top one here
  case $model in bpr) kind=bpr ;; dynamic) mode=dynamic; epochs=1; blocks=(--set model.trainable_layers=1) ;; esac
  [ "$size" = full ] && epochs=1
  local name="$size-$model-p$procs-shm$shm-sparse$sparse-shared$shared-shard$shard-$again"
  "$launch" --num-processes "$procs" --master-port 0 configs/default.toml \
    "${bpr_id[@]}" \
    --set run.output_dir=\""$out"\" --set run.name=\""$name"\" \
    --set data.synthetic=\""$size"\" --set model.kind=\""$kind"\" \
    --set model.text_mode=\""$mode"\" --set train.epochs="$epochs" \
    "${blocks[@]}" --set model.max_text_tokens=32 \
    --set checkpoint.resume=\"never\" --set eval.patience=0 \
    --set batch.global=256 --set batch.micro=64 \
    --set dist.shared_memory="$shm" --set dist.sparse_embeddings="$sparse" \
    --set dist.shared_tables="$shared" --set dist.shard_optimizer="$shard" \
    >"$out/$name.log" 2>&1 || { echo "$name failed: see $out/$name.log" >&2; tail -3 "$out/$name.log" >&2; exit 1; }
  echo "$out/$name"
}

# Both figures of a run directory: "<summary samples/s> <steps samples/s>"
figures() {
  python3 - "$1/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
s = next(x for x in rows if x.get("kind") == "summary")
print(round(s["samples_per_s"]), round(s["steps"] * 256 / s["epochs"] / s["seconds_per_epoch"]))
PY
}

# The median of the numbers on stdin
median() { python3 -c 'import statistics,sys; print(round(statistics.median(int(x) for x in sys.stdin.read().split())))'; }

repeat=${REPEAT:-3}
ways=("1 true true true true" "2 false false false false" "2 true false false false" "2 true true false false" "2 true true true false" "2 true true true true")
echo "| data | model | 1 process | 2, sockets | 2, shm | 2, shm+sparse | 2, shared tables | 2, sharded (default) | 2 / 1 (default) | 2 / 1, steps only |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for size in $sizes; do
  for model in $models; do
    rm -f "$out"/figures-*
    for i in $(seq "$repeat"); do
      for w in ${WAYS:-${!ways[@]}}; do
        dir=$(run "$size" "$model" ${ways[$w]} "$i")
        figures "$dir" >>"$out/figures-$w"
      done
    done
    cells=() steps=()
    for w in "${!ways[@]}"; do
      if [ -s "$out/figures-$w" ]; then
        cells+=("$(cut -d' ' -f1 "$out/figures-$w" | median)")
        steps+=("$(cut -d' ' -f2 "$out/figures-$w" | median)")
      else
        cells+=("-") steps+=("-")
      fi
    done
    ratio=$(python3 -c "import sys; a, b = sys.argv[1:]; print('-' if '-' in (a, b) else f'{int(a) / int(b):.2f}x')" "${cells[5]}" "${cells[0]}")
    step_ratio=$(python3 -c "import sys; a, b = sys.argv[1:]; print('-' if '-' in (a, b) else f'{int(a) / int(b):.2f}x')" "${steps[5]}" "${steps[0]}")
    echo "| $size | $model | ${cells[0]} | ${cells[1]} | ${cells[2]} | ${cells[3]} | ${cells[4]} | ${cells[5]} | $ratio | $step_ratio |"
  done
done
