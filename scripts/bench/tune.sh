#!/usr/bin/env bash
# A small hyper-parameter search on the validation split only (the test split is never read):
# for each model, every learning rate (and for gpt2rec every text_l2) is trained once with 2
# processes, and the best validation NDCG@10 of each run is printed; the best setting per model
# is printed last. The configs/ml-100k.toml values come from this.
#
#   bash scripts/bench/tune.sh [CONFIG] [--set k=v ...]     default CONFIG: configs/ml-100k.toml
#
#   LRS        learning rates to try          (default: "5e-4 1e-3 2e-3 5e-3")
#   TEXT_L2S   gpt2rec text_l2 values to try  (default: "1e-3 1e-2 1e-1")
#   MODELS     models                         (default: "bpr gpt2rec")
#   NPROC      processes                      (default: 2)
set -eu
cd "$(dirname "$0")/../.."
config=configs/ml-100k.toml
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  config="$1"
  shift
fi
lrs="${LRS:-5e-4 1e-3 2e-3 5e-3}"
text_l2s="${TEXT_L2S:-1e-3 1e-2 1e-1}"
models="${MODELS:-bpr gpt2rec}"
nproc="${NPROC:-2}"
out="scripts/bench/out/tune-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
[ -x target/release/launch ] || cargo build --release --workspace

# Best validation ndcg@10 in a run's metrics.jsonl (valid split only).
best_valid() {
  python3 -c '
import json, sys
best = max((r["ndcg@10"], r["epoch"]) for r in map(json.loads, open(sys.argv[1]))
           if r.get("kind") == "eval" and r.get("split") == "valid")
print(f"{best[0]:.4f} {best[1]}")' "$1"
}

results="$out/results.txt"
: >"$results"
echo "tune: $config, $nproc processes; runs in $out"
printf '%-8s %-7s %-8s %-12s %s\n' model lr text_l2 "valid ndcg@10" epoch
for model in $models; do
  l2s="-"
  [ "$model" = gpt2rec ] && l2s="$text_l2s"
  for lr in $lrs; do
    for tl2 in $l2s; do
      name="tune-$model-lr$lr-tl2$tl2"
      sets=(--set "model.kind=\"$model\"" --set "train.lr=$lr" --set "run.name=\"$name\""
            --set "run.output_dir=\"$out\"")
      [ "$tl2" != - ] && sets+=(--set "model.text_l2=$tl2")
      if ! ./target/release/launch --num-processes "$nproc" --master-port 0 "$config" "${sets[@]}" "$@" \
          >"$out/$name.log" 2>&1; then
        echo "tune: $name failed; see $out/$name.log" >&2
        continue
      fi
      read -r score epoch < <(best_valid "$out/$name/metrics.jsonl")
      printf '%-8s %-7s %-8s %-12s %s\n' "$model" "$lr" "$tl2" "$score" "$epoch" | tee -a "$results"
    done
  done
done
echo "best per model (validation NDCG@10):"
for model in $models; do
  grep "^$model " "$results" | sort -k4 -gr | head -1
done
