#!/usr/bin/env bash
# What makes the GPT-2 recommender earn its place on real data: the ablation in docs/figures.md.
# Trains, on real MovieLens-100k with configs/ml-100k.toml (10% cold items, 10% cold users),
# plain BPR and the model with each choice of loss, capacity, user tower and text, over several
# seeds (each seed is also another split), and prints the mean of test NDCG@10 on warm items,
# on cold items and for cold users, and the mean wall seconds of a run.
#
#   bash scripts/bench/ablation.sh [--set k=v ...]      extra sets go to every run
#
#   SEEDS   seeds (default: "1 2 3")     NPROC   processes (default: 2)
#   ONLY    run only the variants whose label contains this text (e.g. "gpt2rec")
set -eu
cd "$(dirname "$0")/../.."
seeds="${SEEDS:-1 2 3}"
nproc="${NPROC:-2}"
config=configs/ml-100k.toml
out="scripts/bench/out/ablation-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
[ -x target/release/launch ] || cargo build --release --workspace
bash scripts/data/ml100k.sh >/dev/null

# name | sets (on top of the config as it ships). The axes: the loss (BPR against one
# negative, or the softmax against every item), the capacity (embedding 64 or 256), the user
# tower (the user's ID row, or the pool of their history, with the item-item matrix as shipped)
# and text (bpr: none; gpt2rec: GPT-2
# features of every user and item).
bpr=(train.loss=\"bpr\" model.user_tower=\"id\" model.item_item=false model.embedding_dim=64 train.lr=1e-3 model.l2=0
  train.epochs=300 train.weight_decay=0.0)
variants=(
  "bpr: BPR loss, ID, 64 (RecBole's BPR)|model.kind=\"bpr\" ${bpr[*]}"
  "gpt2rec: BPR loss, ID, 64 (before)|${bpr[*]} model.text_l2=1e-2"
  "MF: softmax, ID, 256|model.kind=\"bpr\" model.user_tower=\"id\" model.item_item=false"
  "MF: softmax, history + item-item, 256|model.kind=\"bpr\""
  "gpt2rec: softmax, ID, 256|model.user_tower=\"id\" model.item_item=false"
  "gpt2rec: softmax, history + item-item, 64|model.embedding_dim=64"
  "gpt2rec: softmax, history + item-item, 256, text_l2 1.0|model.text_l2=1.0"
  "gpt2rec: softmax, history, 256, weight decay 0.3 (shipped until 2026-11-29)|model.item_item=false train.weight_decay=0.3"
  "gpt2rec: softmax, history + item-item, 256, text_l2 0.1 (shipped)|"
)
# ONLY: run just the variants whose label contains this text.
if [ -n "${ONLY:-}" ]; then
  kept=()
  for v in "${variants[@]}"; do [[ "${v%%|*}" == *"$ONLY"* ]] && kept+=("$v"); done
  variants=("${kept[@]}")
fi

# "warm cold_items cold_users pop_warm pop_cold_users": test NDCG@10 from a run's summary lines
# (`test ndcg@10: X vs popularity Y`, `cold items ...`, `cold users ...`).
scores() {
  python3 -c '
import re, sys
text = open(sys.argv[1]).read()
def pair(what):
    m = re.search(what + r" ndcg@10: ([0-9.]+) vs popularity ([0-9.]+)", text)
    return (float(m.group(1)), float(m.group(2))) if m else (float("nan"), float("nan"))
(w, pw), (ci, _), (cu, pu) = pair("test"), pair("cold items"), pair("cold users")
print(w, ci, cu, pw, pu)' "$1"
}

echo "ablation: $config, seeds $seeds, $nproc processes; runs in $out"
printf '%-45s %10s %11s %11s %7s\n' "model" "warm test" "cold items" "cold users" "wall s"
for v in "${variants[@]}"; do
  label="${v%%|*}"
  read -r -a kv <<<"${v#*|}"
  sets=()
  for s in ${kv[@]+"${kv[@]}"}; do sets+=(--set "$s"); done
  rows=""
  for seed in $seeds; do
    name="abl-$(echo "$label" | tr -c 'a-z0-9' '-' | tr -s '-')-s$seed"
    start=$(date +%s)
    if ! ./target/release/launch --num-processes "$nproc" --master-port 0 "$config" ${sets[@]+"${sets[@]}"} \
        --set "run.seed=$seed" --set "run.name=\"$name\"" --set "run.output_dir=\"$out\"" "$@" \
        >"$out/$name.log" 2>&1; then
      echo "ablation: $name failed; see $out/$name.log" >&2
      exit 1
    fi
    rows+="$(scores "$out/$name.log") $(($(date +%s) - start))"$'\n'
  done
  printf '%s' "$rows" | python3 -c '
import sys
label = sys.argv[1]
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
mean = [sum(c) / len(c) for c in zip(*rows)]
print(f"{label:<45} {mean[0]:10.4f} {mean[1]:11.4f} {mean[2]:11.4f} {mean[5]:7.0f}")
with open(sys.argv[2], "a") as pop:
    print(f"{mean[3]:.4f} {mean[4]:.4f}", file=pop)
' "$label" "$out/pop.txt"
done
read -r pop_warm pop_cold_users <"$out/pop.txt"
printf '%-45s %10s %11s %11s\n' "popularity (same splits)" "$pop_warm" "-" "$pop_cold_users"
