#!/usr/bin/env bash
# configs/ml-100k.toml against EASE on several random splits of real MovieLens-100k (cold
# shares 0, as scripts/bench/vs_recbole.sh exports them): one training per split, and per split
# the test NDCG@10 and Recall@10 of both, and how far ours is from EASE on NDCG@10 paired over
# the same test users with its 95% confidence interval (the run's own last line), then the
# means over the splits and the range of the change. A split's test users are a sample: on
# ML-100k, 941 of them put about ±2.7% around a change of NDCG@10, so one split cannot tell
# two models 1% apart. The splits share their users (each is another random division of the
# same ratings), so their intervals are not independent and are not pooled into one.
#
#   bash scripts/bench/splits.sh [--set k=v ...]
#
#   SPLITS   data.split_seed values (default: 42 7 1 2 3 4 5 6 8 9; 42 is the split
#            configs/ml-100k.toml was tuned on, by its validation)
#   SEED     run.seed of every run (default: 42)
#   NPROC    processes (default: 2)
#   OUT      where the runs go (default: scripts/bench/out/splits-DATE)
set -eu
cd "$(dirname "$0")/../.."
splits="${SPLITS:-42 7 1 2 3 4 5 6 8 9}"
seed="${SEED:-42}"
nproc="${NPROC:-2}"
out="${OUT:-scripts/bench/out/splits-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
bash scripts/data/ml100k.sh >/dev/null
cargo build --release -p gptrec-launcher -p gptrec-worker >/dev/null 2>&1 ||
  cargo build --release -p gptrec-launcher -p gptrec-worker
[ -n "${splits// /}" ] || { echo "splits: SPLITS is empty" >&2; exit 2; }

# `split ours_ndcg ease_ndcg change low high ours_recall ease_recall` from a run's output.
figures() {
  python3 -c '
import re, sys
split, text = sys.argv[1], open(sys.argv[2]).read()
def metric(label, name):
    m = re.search(r"\]\s+" + label + r"\s+users=\d+ .*?\b" + name + r"=([0-9.]+)", text)
    return m.group(1)
line = re.search(r"test ndcg@10: ([0-9.]+) vs .*EASE ([0-9.]+) \(([-+0-9.]+)%, 95% CI ([-+0-9.]+)% to ([-+0-9.]+)%\)", text)
if line is None:
    sys.exit(f"splits: no \"test ndcg@10: ... EASE ... (..., 95% CI ...)\" line in {sys.argv[2]}")
print(split, *line.groups(), metric("test", "recall@10"), metric("ease test", "recall@10"))
' "$@"
}

results="$out/results.txt"
: >"$results"
echo "splits: configs/ml-100k.toml, run.seed $seed, $nproc processes; runs in $out"
printf '%-6s %-8s %-8s %-26s %-10s %s\n' split ours EASE "ours vs EASE (95% CI)" "ours R@10" "EASE R@10"
for split in $splits; do
  name="split-$split"
  if ! ./target/release/launch --num-processes "$nproc" --master-port 0 configs/ml-100k.toml \
      --set "run.name=\"$name\"" --set "run.output_dir=\"$out\"" --set "run.seed=$seed" \
      --set data.cold_items=0 --set data.cold_users=0 --set "data.split_seed=$split" "$@" \
      >"$out/$name.log" 2>&1; then
    echo "splits: $name failed; see $out/$name.log" >&2
    exit 1
  fi
  row=$(figures "$split" "$out/$name.log")
  read -r s ours ease change low high r_ours r_ease <<<"$row"
  echo "$s $ours $ease $change $low $high $r_ours $r_ease" >>"$results"
  printf '%-6s %-8s %-8s %-26s %-10s %s\n' "$s" "$ours" "$ease" "$change% ($low% to $high%)" "$r_ours" "$r_ease"
done
python3 -c '
import sys
rows = [l.split() for l in open(sys.argv[1])]
mean = lambda i: sum(float(r[i]) for r in rows) / len(rows)
above = sum(float(r[1]) >= float(r[2]) for r in rows)
changes = sorted(float(r[3]) for r in rows)
print(f"mean over {len(rows)} splits: NDCG@10 ours {mean(1):.4f}, EASE {mean(2):.4f} "
      f"({(mean(1) / mean(2) - 1) * 100:+.1f}%); Recall@10 ours {mean(6):.4f}, EASE {mean(7):.4f} "
      f"({(mean(6) / mean(7) - 1) * 100:+.1f}%); ours at or above EASE on NDCG@10 in {above} of "
      f"{len(rows)}, the change from {changes[0]:+.1f}% to {changes[-1]:+.1f}%")
' "$results"
