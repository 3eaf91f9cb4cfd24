#!/usr/bin/env bash
# Cold start: warm and cold quality of every recommender on the same split. A share of the items
# and of the users (data.cold_items, data.cold_users; 10% each, as configs/default.toml) is held
# out of training entirely. After training, the best model is tested on
#   warm:       each warm user's test items among the warm items (the usual test),
#   cold items: each warm user's items among the cold items (ranked among themselves),
#   cold users: each cold user's items among the warm items,
# for pop, bpr, and the GPT-2 recommender in cached and dynamic text mode, on the full-size
# generated data (6,040 users x 3,883 movies, ~1M ratings; its metadata carries signal: genres
# and demographics drive the ratings). 1 process; global batch 256 (micro 64 x grad_accum 4).
#
# Usage: scripts/bench/cold_start.sh [SIZE] [EPOCHS]
#   SIZE   "full" (default) or "small"
#   EPOCHS epochs of bpr and cached (default 6); dynamic runs 1 (about 10 min here on full)
#   BENCH_DYNAMIC=0 skips dynamic mode
set -eu
cd "$(dirname "$0")/../.."
size="${1:-full}"
epochs="${2:-6}"
. scripts/bench/lib.sh

results="$out/cold.tsv"
: >"$results"
run_case() { # kind mode epochs
  local kind=$1 mode=$2 e=$3 name="$size-$1-$2" t0 t1 extra=()
  [ "$mode" = dynamic ] && extra=(--set model.trainable_layers=1)
  t0=$(date +%s.%N)
  launch_logged "$name" --num-processes 1 --master-port 0 configs/default.toml \
      "${bpr_id[@]}" \
      --set run.output_dir=\""$out"\" --set run.name=\""$name"\" \
      --set data.synthetic=\""$size"\" --set data.cold_items=0.1 --set data.cold_users=0.1 \
      --set model.kind=\""$kind"\" --set model.text_mode=\""$mode"\" "${extra[@]}" \
      --set model.max_text_tokens=32 --set train.epochs="$e" \
      --set checkpoint.resume=\"never\" --set eval.patience=0 \
      --set batch.global=256 --set batch.micro=64 || return 1
  t1=$(date +%s.%N)
  python3 - "$out/$name/metrics.jsonl" "$kind" "$mode" "$t0" "$t1" >>"$results" <<'PY'
import json, sys
path, kind, mode, t0, t1 = sys.argv[1:]
recs = [json.loads(l) for l in open(path)]
def split(name):
    r = next(r for r in recs if r.get("kind") == "eval" and r.get("split") == name)
    return [f"{r['recall@10']:.4f}", f"{r['ndcg@10']:.4f}"]
label = kind if kind != "gpt2rec" else f"gpt2rec {mode}"
print("\t".join([label] + split("test") + split("cold_items") + split("cold_users")
                + [f"{float(t1) - float(t0):.0f}"]))
PY
  tail -1 "$results"
}

run_case pop cached 1
run_case bpr cached "$epochs"
run_case gpt2rec cached "$epochs"
[ "${BENCH_DYNAMIC:-1}" = 0 ] || run_case gpt2rec dynamic 1

echo
echo "| model | warm Recall@10 | warm NDCG@10 | cold items Recall@10 | cold items NDCG@10 | cold users Recall@10 | cold users NDCG@10 | wall s |"
echo "|---|---|---|---|---|---|---|---|"
awk -F'\t' '{printf "| %s | %s | %s | %s | %s | %s | %s | %s |\n", $1,$2,$3,$4,$5,$6,$7,$8}' "$results"
