#!/usr/bin/env bash
# Overlap of the gradient all-reduce with the backward pass (`dist.overlap_backward`) on this
# machine: 2 processes with the all-reduce path (`dist.shard_optimizer=false`, where buckets
# are all-reduced at all), without and with overlap, for bpr, gpt2rec cached and gpt2rec
# dynamic (tiny GPT-2, its top block training, 32 text tokens: the only one with dense buckets
# of some size, and small ones: about 200 KiB), on the built-in default data. Global batch
# 256, micro 64 (so 2 micro-batches a step per rank), OMP_NUM_THREADS=1,
# `checkpoint.resume = never`. BUCKET_MB sets `dist.bucket_mb` (default: the config's 25, one
# bucket for all of those models' dense gradients, which then can only start at the end).
#
# "mlp" is a model with real-size dense buckets instead: runtime's `overlap_bench` example, an
# MLP of 4 layers 1024 wide (16 MiB of gradients, 5 MiB buckets: one layer each), 2 ranks as
# threads of one process (not pinned) over a real ring, 2 micro-batches of 64 a step; it prints
# its own table (milliseconds per step, medians of REPEAT runs, the two settings alternating).
#
# Printed per configuration, each the median of REPEAT (default 5) runs, the runs of one model
# interleaved (off, on, off, on, ...): samples/s of the trainer's summary (wall time of
# training, validation and checkpoints included), "steps" samples/s (over the epochs' own
# time), and the per-step milliseconds of metrics.jsonl's summary (`time_per_step_ms`, the
# mean over the ranks): compute (forward and backward; with overlap it includes the buckets'
# all-reduce that ran during backward), collective (what was left to wait for after backward,
# the summary, the sparse exchange) and update.
#
# Usage: [REPEAT=5] [TRANSPORTS="shm"] [BUCKET_MB=25] scripts/bench/overlap.sh [MODELS]
#   MODELS      "bpr cached dynamic mlp" (default) or a subset
#   TRANSPORTS  "shm" (dist.shared_memory, the default) and/or "sockets" (the tcp ring over
#               loopback, closer to what crosses a network)
set -eu
cd "$(dirname "$0")/../.."
models="${1:-bpr cached dynamic mlp}"
. scripts/bench/lib.sh
export OMP_NUM_THREADS=1

run() { # model transport overlap repeat -> the run directory
  local model=$1 transport=$2 overlap=$3 again=$4 kind=gpt2rec mode=cached epochs=2 shm=true
  local blocks=() # only dynamic text trains GPT-2 blocks: its top one here
  case $model in bpr) kind=bpr ;; dynamic) mode=dynamic; epochs=1; blocks=(--set model.trainable_layers=1) ;; esac
  [ "$transport" = sockets ] && shm=false
  local name="overlap-$model-$transport-$overlap-$again"
  launch_logged "$name" --num-processes 2 --master-port 0 configs/default.toml \
    "${bpr_id[@]}" \
    --set run.output_dir=\""$out"\" --set run.name=\""$name"\" \
    --set model.kind=\""$kind"\" --set model.text_mode=\""$mode"\" \
    "${blocks[@]}" --set model.max_text_tokens=32 --set train.epochs="$epochs" \
    --set checkpoint.resume=\"never\" --set eval.patience=0 \
    --set batch.global=256 --set batch.micro=64 \
    --set dist.shard_optimizer=false --set dist.shared_memory="$shm" \
    --set dist.overlap_backward="$overlap" --set dist.bucket_mb="${BUCKET_MB:-25}" || exit 1
  echo "$out/$name"
}

# One line of figures of a run directory: samples/s, steps samples/s, compute, collective and
# update ms per step (mean over ranks).
figures() {
  python3 - "$1/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
s = next(x for x in rows if x.get("kind") == "summary")
t = s["time_per_step_ms"]
mean = lambda k: sum(r[k] for r in t) / len(t)
print(s["samples_per_s"], s["steps"] * 256 / s["epochs"] / s["seconds_per_epoch"],
      mean("compute"), mean("collective"), mean("update"))
PY
}

# Medians of the columns of a file of figures lines, formatted.
medians() {
  python3 - "$1" <<'PY'
import statistics, sys
cols = list(zip(*(map(float, l.split()) for l in open(sys.argv[1]) if l.strip())))
m = [statistics.median(c) for c in cols]
print(f"{m[0]:,.0f} | {m[1]:,.0f} | {m[2]:.2f} | {m[3]:.2f} | {m[4]:.2f} | {len(cols[0])}")
PY
}

# The MLP with real-size buckets, through TRANSPORT: mlp_bench TRANSPORT
mlp_bench() {
  local sockets=0
  [ "$1" = sockets ] && sockets=1
  echo "mlp, $1:"
  target/release/examples/overlap_bench repeat="$repeat" sockets="$sockets"
}

repeat=${REPEAT:-5}
case " $models " in *" mlp "*)
  cargo build --release -p gptrec-runtime --features test-support --example overlap_bench >/dev/null 2>&1 ||
    cargo build --release -p gptrec-runtime --features test-support --example overlap_bench ;;
esac
echo "| model | transport | overlap | samples/s | steps samples/s | compute ms | collective ms | update ms | runs |"
echo "|---|---|---|---|---|---|---|---|---|"
for model in $models; do
  [ "$model" = mlp ] && continue
  for transport in ${TRANSPORTS:-shm}; do
    rm -f "$out"/figures-overlap-*
    for i in $(seq "$repeat"); do
      for overlap in false true; do
        dir=$(run "$model" "$transport" "$overlap" "$i")
        figures "$dir" >>"$out/figures-overlap-$overlap"
      done
    done
    for overlap in false true; do
      echo "| $model | $transport | $overlap | $(medians "$out/figures-overlap-$overlap") |"
    done
  done
done
case " $models " in *" mlp "*)
  for transport in ${TRANSPORTS:-shm}; do mlp_bench "$transport"; done ;;
esac
