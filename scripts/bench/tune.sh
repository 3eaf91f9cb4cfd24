#!/usr/bin/env bash
# A small hyper-parameter search on the validation split only (the test split is never read):
# every combination of the grid is trained once with 2 processes, and the best validation
# NDCG@10 of each run is printed; the best combination per model kind is printed last. The
# configs/ml-100k.toml values come from this.
#
#   bash scripts/bench/tune.sh [CONFIG] [--set k=v ...]     default CONFIG: configs/ml-100k.toml
#
#   GRID     space-separated KEY=V1,V2,... (config keys, strings quoted as in --set); every
#            combination is one run. Default: the loss, user tower and regularisation search
#            behind configs/ml-100k.toml:
#            model.kind="gpt2rec" train.loss="softmax" model.embedding_dim=256 train.lr=3e-3
#            model.user_tower="history","both" model.l2=1e-2 model.text_l2=1e-1,1.0
#            Every run is CONFIG as it ships plus the grid's values: earlier searches in
#            docs/figures.md ran on the config of their day (e.g. 300 epochs, no weight decay).
#   NPROC    processes (default: 2)
#   OUT      where the runs go (default: scripts/bench/out/tune-DATE)
# For instance the earlier search of BPR's learning rate:
#   GRID='model.kind="bpr" train.lr=5e-4,1e-3,2e-3,5e-3' bash scripts/bench/tune.sh
set -eu
cd "$(dirname "$0")/../.."
config=configs/ml-100k.toml
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  config="$1"
  shift
fi
grid="${GRID:-model.kind=\"gpt2rec\" train.loss=\"softmax\" model.embedding_dim=256 train.lr=3e-3 model.user_tower=\"history\",\"both\" model.l2=1e-2 model.text_l2=1e-1,1.0}"
nproc="${NPROC:-2}"
out="${OUT:-scripts/bench/out/tune-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
[ -x target/release/launch ] || cargo build --release --workspace

# One line per combination: its --set values, tab-separated.
combinations() {
  python3 -c '
import itertools, sys
axes = []
for word in sys.argv[1].split():
    key, _, values = word.partition("=")
    axes.append([f"{key}={v}" for v in values.split(",")])
for combo in itertools.product(*axes):
    print("\t".join(combo))' "$grid"
}

# Best validation ndcg@10 in a run's metrics.jsonl (valid split only), and its epoch.
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
printf '%-13s %-6s %-7s %s\n' "valid ndcg@10" epoch wall settings
n=0
while IFS=$'\t' read -r -a sets; do
  n=$((n + 1))
  name="tune-$n"
  args=(--set "run.name=\"$name\"" --set "run.output_dir=\"$out\"")
  for s in "${sets[@]}"; do args+=(--set "$s"); done
  start=$(date +%s)
  if ! ./target/release/launch --num-processes "$nproc" --master-port 0 "$config" "${args[@]}" "$@" \
      >"$out/$name.log" 2>&1; then
    echo "tune: $name (${sets[*]}) failed; see $out/$name.log" >&2
    continue
  fi
  read -r score epoch < <(best_valid "$out/$name/metrics.jsonl")
  printf '%-13s %-6s %-7s %s\n' "$score" "$epoch" "$(($(date +%s) - start))s" "${sets[*]}" | tee -a "$results"
done < <(combinations)
echo "best per model kind (validation NDCG@10):"
for kind in $(grep -o 'model.kind="[a-z0-9]*"' "$results" | sort -u); do
  grep -F "$kind" "$results" | sort -k1 -gr | head -1
done
