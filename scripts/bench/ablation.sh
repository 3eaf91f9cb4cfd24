#!/usr/bin/env bash
# What makes the GPT-2 recommender earn its place on real data: the ablation in docs/figures.md.
# Trains, on real MovieLens-100k with configs/ml-100k.toml (10% cold items, 10% cold users),
# plain BPR and gpt2rec with each fusion choice, over several seeds (each seed is also another
# split), and prints the mean of test NDCG@10 on warm items, on cold items and for cold users.
#
#   bash scripts/bench/ablation.sh [--set k=v ...]      extra sets go to every run
#
#   SEEDS   seeds (default: "1 2 3")     NPROC   processes (default: 2)
set -eu
cd "$(dirname "$0")/../.."
seeds="${SEEDS:-1 2 3}"
nproc="${NPROC:-2}"
config=configs/ml-100k.toml
out="scripts/bench/out/ablation-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
[ -x target/release/launch ] || cargo build --release --workspace
bash scripts/data/ml100k.sh >/dev/null

# name | sets
variants=(
  "bpr|model.kind=\"bpr\""
  "gpt2rec: random proj, text_l2 0 (before)|model.text_proj_init=\"random\" model.text_l2=0"
  "gpt2rec: random proj, text_l2 1e-2|model.text_proj_init=\"random\" model.text_l2=1e-2"
  "gpt2rec: zero proj, text_l2 0|model.text_proj_init=\"zero\" model.text_l2=0"
  "gpt2rec: zero proj, text_l2 1e-2 (shipped)|model.text_proj_init=\"zero\" model.text_l2=1e-2"
)

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
printf '%-45s %10s %11s %11s\n' "model" "warm test" "cold items" "cold users"
for v in "${variants[@]}"; do
  label="${v%%|*}"
  read -r -a kv <<<"${v#*|}"
  sets=()
  for s in "${kv[@]}"; do sets+=(--set "$s"); done
  rows=""
  for seed in $seeds; do
    name="abl-$(echo "$label" | tr -c 'a-z0-9' '-' | tr -s '-')-s$seed"
    if ! ./target/release/launch --num-processes "$nproc" --master-port 0 "$config" "${sets[@]}" \
        --set "run.seed=$seed" --set "run.name=\"$name\"" --set "run.output_dir=\"$out\"" "$@" \
        >"$out/$name.log" 2>&1; then
      echo "ablation: $name failed; see $out/$name.log" >&2
      exit 1
    fi
    rows+="$(scores "$out/$name.log")"$'\n'
  done
  printf '%s' "$rows" | python3 -c '
import sys
label = sys.argv[1]
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
mean = [sum(c) / len(c) for c in zip(*rows)]
print(f"{label:<45} {mean[0]:10.4f} {mean[1]:11.4f} {mean[2]:11.4f}")
with open(sys.argv[2], "a") as pop:
    print(f"{mean[3]:.4f} {mean[4]:.4f}", file=pop)
' "$label" "$out/pop.txt"
done
read -r pop_warm pop_cold_users <"$out/pop.txt"
printf '%-45s %10s %11s %11s\n' "popularity (same splits)" "$pop_warm" "-" "$pop_cold_users"
