#!/usr/bin/env bash
# Our data-parallel trainer against plain PyTorch DDP (gloo) on the same model, batch and data,
# side by side in one script run: training samples/s with 1 and 2 processes for bpr and gpt2rec
# (cached text features), on generated data of the default size ("small") and full size.
# The peer is scripts/bench/ddp_peer.py (what it mirrors is in its header); both are started by
# our `launch`, with OMP_NUM_THREADS=1, global batch 256, micro 64. samples/s is each trainer's
# own figure over its training steps (evaluation excluded).
#
# Usage: scripts/bench/vs_pytorch.sh [SIZES] [MODELS] [PROCS]
#   SIZES "small full" (default), MODELS "bpr cached" (default), PROCS "1 2" (default);
#   EPOCHS (env) epochs per run: default 2 on small, 1 on full.
set -eu
cd "$(dirname "$0")/../.."
sizes="${1:-small full}"
models="${2:-bpr cached}"
procs_list="${3:-1 2}"
. scripts/bench/lib.sh
export OMP_NUM_THREADS=1

ours() { # data model procs epochs -> samples/s
  local data=$1 model=$2 procs=$3 epochs=$4 kind=gpt2rec
  [ "$model" = bpr ] && kind=bpr
  local name="ours-$(basename "$data")-$model-p$procs"
  "$launch" --num-processes "$procs" --master-port 0 configs/default.toml \
    "${bpr_id[@]}" \
    --set run.output_dir=\""$out"\" --set run.name=\""$name"\" \
    --set data.dir=\""$data"\" --set model.kind=\""$kind"\" --set model.text_mode=\"cached\" \
    --set train.epochs="$epochs" --set checkpoint.resume=\"never\" --set eval.patience=0 \
    --set batch.global=256 --set batch.micro=64 \
    >"$out/$name.log" 2>&1 || { echo "$name failed: see $out/$name.log" >&2; tail -3 "$out/$name.log" >&2; exit 1; }
  summary_samples_per_s "$out/$name"
}

peer() { # data model procs epochs -> samples/s
  local data=$1 model=$2 procs=$3 epochs=$4
  local name="peer-$(basename "$data")-$model-p$procs"
  "$launch" --num-processes "$procs" --master-port 0 -- \
    python scripts/bench/ddp_peer.py "$data" "$model" "$epochs" 256 64 >"$out/$name.log" 2>&1 \
    || { echo "$name failed: see $out/$name.log" >&2; tail -3 "$out/$name.log" >&2; exit 1; }
  sed -n -E 's/.*peer samples\/s ([0-9]+).*/\1/p' "$out/$name.log" | head -1
}

echo "PyTorch $(python -c 'import torch; print(torch.__version__)' 2>/dev/null)"
echo "| data | model | processes | ours (samples/s) | PyTorch DDP gloo (samples/s) | ours / PyTorch |"
echo "|---|---|---|---|---|---|"
for size in $sizes; do
  data="$out/data-$size"
  [ -f "$data/ratings.dat" ] || target/release/gen-data --size "$size" "$data" >/dev/null
  epochs=${EPOCHS:-2}
  [ "$size" = full ] && epochs=${EPOCHS:-1}
  for model in $models; do
    for procs in $procs_list; do
      a=$(ours "$data" "$model" "$procs" "$epochs")
      b=$(peer "$data" "$model" "$procs" "$epochs")
      echo "| $size | $model | $procs | $a | $b | $(python3 -c "print(f'{$a / $b:.2f}x')") |"
    done
  done
done
