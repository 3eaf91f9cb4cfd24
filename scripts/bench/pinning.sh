#!/usr/bin/env bash
# What pinning workers to CPUs (`--pin`: disjoint CPU sets per local rank, OMP_NUM_THREADS to
# match) does to the 2-process training figures on this machine, against the default (not
# pinned, as torchrun), with a 1-process run for the 2 / 1 ratio. bpr and gpt2rec (cached) on the default ("small") data,
# global 256, micro 64, the shipped dist settings, `checkpoint.resume = never`. samples/s is the
# trainer's summary figure; each cell is the median of REPEAT runs (default 3), interleaved.
#
# Usage: [REPEAT=3] scripts/bench/pinning.sh [MODELS]     MODELS: "bpr cached" (default)
set -eu
cd "$(dirname "$0")/../.."
models="${1:-bpr cached}"
. scripts/bench/lib.sh
unset OMP_NUM_THREADS # launch sets it: to the CPUs of each worker's set when pinned

run() { # model procs pin repeat -> the run directory
  local model=$1 procs=$2 pin=$3 again=$4 kind=gpt2rec
  [ "$model" = bpr ] && kind=bpr
  local name="$model-p$procs-$pin-$again" flags=()
  [ "$pin" = pin ] && flags=(--pin)
  launch_logged "$name" --num-processes "$procs" "${flags[@]}" configs/default.toml \
    "${bpr_id[@]}" \
    --set run.output_dir=\""$out"\" --set run.name=\""$name"\" --set model.kind=\""$kind"\" \
    --set train.epochs=2 --set checkpoint.resume=\"never\" --set eval.patience=0 \
    --set batch.global=256 --set batch.micro=64 || exit 1
  echo "$out/$name"
}

median() { python3 -c 'import statistics,sys; print(round(statistics.median(int(x) for x in sys.stdin.read().split())))'; }

ways=("1 pin" "2 pin" "2 nopin")
echo "| model | 1 process | 2, --pin | 2, not pinned (default) | 2 / 1 --pin | 2 / 1 not pinned |"
echo "|---|---|---|---|---|---|"
for model in $models; do
  rm -f "$out"/pin-*
  for i in $(seq "${REPEAT:-3}"); do
    for w in "${!ways[@]}"; do
      summary_samples_per_s "$(run "$model" ${ways[$w]} "$i")" >>"$out/pin-$w"
    done
  done
  cells=()
  for w in "${!ways[@]}"; do cells+=("$(median <"$out/pin-$w")"); done
  ratios=$(python3 -c "print(f'{${cells[1]} / ${cells[0]}:.2f}x | {${cells[2]} / ${cells[0]}:.2f}x')")
  echo "| $model | ${cells[0]} | ${cells[1]} | ${cells[2]} | $ratios |"
done
