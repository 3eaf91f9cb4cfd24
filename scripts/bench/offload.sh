#!/usr/bin/env bash
# dist.offload = "optimizer" against "none" on the CPU, through shared memory at world 2, for
# ZeRO stages 0, 1 and 2 (lib.sh's zero_grid: the dense BPR model of zero.sh, 1,800 x EMBED
# rows). On a CPU the moments are in host memory either way, so what this measures is the price
# of the path a GPU run takes: each step's copies of the values and gradients to the host and
# of the values back. Per run: the estimate's optimizer term and peak, the measured peak RSS,
# steady samples/s, rank 0's update ms per step, and test NDCG@10 (offloaded must print the
# same). What it saves on a GPU is measured by scripts/gpu/check.sh's offload step.
#
# Usage: scripts/bench/offload.sh      (EMBED=32768 by default: 59M values; about 6 minutes here)
set -eu
cd "$(dirname "$0")/../.."
. scripts/bench/lib.sh
embed="${EMBED:-32768}"
base=$out
for offload in none optimizer; do
  out=$base/$offload
  mkdir -p "$out"
  ZERO_TRANSPORTS=shm ZERO_WORLDS=2 zero_grid "0 1 2" \
    --set data.synthetic=\"small\" --set model.kind=\"bpr\" --set model.embedding_dim="$embed" \
    --set batch.global=2048 --set dist.offload=\""$offload"\"
done

python3 - "$base" "$embed" <<'PY'
import os, sys
sys.path.insert(0, "scripts/bench")
import zero_runs
base, embed = sys.argv[1], sys.argv[2]
print("BPR, 1,800 x %s dense rows, one epoch, shared memory, world 2" % embed)
print("| dist.zero | dist.offload | optimizer term (estimate) MiB | estimated peak MiB | measured peak RSS MiB | steady samples/s | update ms / step | test NDCG@10 |")
print("|---|---|---|---|---|---|---|---|")
rows = {}
for offload in ("none", "optimizer"):
    for _, _, zero, mem, terms, summary, test in zero_runs.runs(os.path.join(base, offload), (0, 1, 2), ("shm",), (2,)):
        rows[(zero, offload)] = (terms["optimizer (AdamW)"], mem["estimate"]["peak_mib"], max(summary["peak_rss_mib"]),
                                 summary["steady_samples_per_s"], summary["steady_time_per_step_ms"]["update"], test["ndcg@10"])
for zero in (0, 1, 2):
    for offload in ("none", "optimizer"):
        print("| %d | %s | %.1f | %.1f | %.1f | %.0f | %.0f | %.4f |" % ((zero, offload) + rows[(zero, offload)]))
PY
