#!/usr/bin/env bash
# Two (or more) builds of `launch` and `worker` compared on the same small training run, the
# builds alternating run by run, so that this machine's minute-to-minute swings (10-15%, more
# when another job runs) fall on all of them alike. Each round runs every build once; the
# figure of a build is the median over the rounds of its samples/s divided by the first build's
# in the same round (the summary figure, and "steps" from the epochs' own time).
#
# Usage: [PROCS=2] [MODEL=bpr] scripts/bench/ab_builds.sh ROUNDS DIR_A DIR_B [DIR ...]
#   DIR    a directory holding a `launch` (and the `worker` beside it) built from one version:
#          e.g. `cp target/release/{launch,worker} /tmp/a/` before a change, /tmp/b/ after
#   PROCS  processes per run (default 2); MODEL bpr (default) or gpt2rec (cached text)
# The run: configs/default.toml on the small built-in data, 2 epochs, global batch 256, micro
# 64, `OMP_NUM_THREADS=1`, as `scripts/bench/scaling.sh` runs it. About 1 s a run here.
set -eu
cd "$(dirname "$0")/../.."
[ $# -ge 3 ] || { sed -n '2,13p' "$0"; exit 2; }
rounds=$1
shift
for d in "$@"; do
  [ -x "$d/launch" ] || { echo "ab_builds: $d/launch: not an executable" >&2; exit 2; }
done
. scripts/setup.sh >&2 # its lines (a first install of torch, about 4 GB) on stderr, the figures on stdout
out=$(mktemp -d)
echo "runs in $out"
export OMP_NUM_THREADS=1
for r in $(seq "$rounds"); do
  i=0
  for d in "$@"; do
    i=$((i + 1))
    "$d/launch" --num-processes "${PROCS:-2}" --master-port 0 configs/default.toml \
      --set train.loss=\"bpr\" --set model.user_tower=\"id\" \
      --set run.output_dir=\""$out"\" --set run.name=\""b$i-$r"\" \
      --set data.synthetic=\"small\" --set model.kind=\""${MODEL:-bpr}"\" \
      --set model.text_mode=\"cached\" --set train.epochs=2 --set model.max_text_tokens=32 \
      --set checkpoint.resume=\"never\" --set eval.patience=0 \
      --set batch.global=256 --set batch.micro=64 >"$out/b$i-$r.log" 2>&1 \
      || { echo "$d failed: see $out/b$i-$r.log" >&2; tail -3 "$out/b$i-$r.log" >&2; exit 1; }
  done
done
python3 - "$out" "$rounds" "$@" <<'PY'
import json, statistics, sys
out, rounds, dirs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def figures(i, r):
    s = next(json.loads(l) for l in open(f"{out}/b{i}-{r}/metrics.jsonl") if '"summary"' in l)
    return s["samples_per_s"], s["steps"] * 256 / s["epochs"] / s["seconds_per_epoch"]
print("| build | samples/s (median) | vs the first, summary | vs the first, steps only |")
print("|---|---|---|---|")
for i, d in enumerate(dirs, 1):
    mine = [figures(i, r) for r in range(1, rounds + 1)]
    first = [figures(1, r) for r in range(1, rounds + 1)]
    ratio = lambda k: statistics.median(a[k] / b[k] for a, b in zip(mine, first))
    print(f"| {d} | {statistics.median(m[0] for m in mine):,.0f} | {ratio(0):.3f} | {ratio(1):.3f} |")
PY
