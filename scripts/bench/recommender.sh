#!/usr/bin/env bash
# Training speed, memory and quality of the recommenders, side by side on the same data:
# `pop`, `bpr`, and the GPT-2 recommender (`gpt2rec`) in `cached` and `dynamic` text mode,
# with 1 and 2 processes on the CPU, on the built-in default (synthetic "small") and on a
# full-size synthetic data set (6,040 users x 3,883 movies x ~1M ratings).
#
# Per run: samples/s and seconds per epoch (training only), peak RSS of each process (the
# kernel's high-water mark), and test Recall@10 / NDCG@10 of the best validation model.
# Every run keeps the global batch (256), so 1 and 2 processes train the same way.
#
# Usage: scripts/bench/recommender.sh [SIZES] [EPOCHS]
#   SIZES  "small full" (default) or one of them
#   EPOCHS epochs per run (default 6 on small, 3 on full; dynamic mode runs 2 / 1)
#   BENCH_DYNAMIC_FULL=0 skips dynamic mode on the full-size data (about 10 min per epoch here)
set -eu
cd "$(dirname "$0")/../.."
sizes="${1:-small full}"
. scripts/bench/lib.sh

results="$out/results.tsv"
: >"$results"
run_case() { # size procs kind mode epochs
  local size=$1 procs=$2 kind=$3 mode=$4 epochs=$5
  local name="$size-$kind-$mode-p$procs"
  local t0 t1 blocks=() # only dynamic text trains GPT-2 blocks: its top one here
  [ "$kind" = gpt2rec ] && [ "$mode" = dynamic ] && blocks=(--set model.trainable_layers=1)
  t0=$(date +%s.%N)
  launch_logged "$name" --num-processes "$procs" --master-port 0 configs/default.toml \
      "${bpr_id[@]}" \
      --set run.output_dir=\""$out"\" --set run.name=\""$name"\" \
      --set data.synthetic=\""$size"\" --set model.kind=\""$kind"\" \
      --set model.text_mode=\""$mode"\" --set train.epochs="$epochs" \
      "${blocks[@]}" --set model.max_text_tokens=32 \
      --set checkpoint.resume=\"never\" --set eval.patience=0 \
      --set batch.global=256 --set batch.micro=64 || return 1
  t1=$(date +%s.%N)
  python3 - "$out/$name/metrics.jsonl" "$name" "$size" "$procs" "$kind" "$mode" "$t0" "$t1" >>"$results" <<'PY'
import json, sys
path, name, size, procs, kind, mode, t0, t1 = sys.argv[1:]
recs = [json.loads(l) for l in open(path)]
test = next(r for r in recs if r.get("kind") == "eval" and r.get("split") == "test")
summ = next((r for r in recs if r.get("kind") == "summary"), {})
sps = summ.get("samples_per_s") or 0
spe = summ.get("seconds_per_epoch")
rss = summ.get("peak_rss_mib") or []
label = kind if kind != "gpt2rec" else f"gpt2rec {mode}"
print("\t".join([size, procs, label,
    f"{sps:.0f}" if sps else "-", f"{spe:.1f}" if spe else "-",
    "/".join(f"{x:.0f}" for x in rss) if rss else "-",
    f"{test['recall@10']:.4f}", f"{test['ndcg@10']:.4f}",
    f"{float(t1) - float(t0):.1f}"]))
PY
  tail -1 "$results"
}

for size in $sizes; do
  if [ "$size" = full ]; then e=${2:-3}; de=1; else e=${2:-6}; de=2; fi
  for procs in 1 2; do
    run_case "$size" "$procs" pop cached 1
    run_case "$size" "$procs" bpr cached "$e"
    run_case "$size" "$procs" gpt2rec cached "$e"
    if [ "$size" = full ] && [ "${BENCH_DYNAMIC_FULL:-1}" = 0 ]; then continue; fi
    run_case "$size" "$procs" gpt2rec dynamic "$de"
  done
done

echo
echo "| data | processes | model | samples/s | s/epoch | peak RSS per process (MiB) | test Recall@10 | test NDCG@10 | wall s |"
echo "|---|---|---|---|---|---|---|---|---|"
awk -F'\t' '{printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1,$2,$3,$4,$5,$6,$7,$8,$9}' "$results"
