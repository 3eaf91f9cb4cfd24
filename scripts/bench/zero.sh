#!/usr/bin/env bash
# ZeRO stages 1 and 2 (`dist.zero = 1`, `2`) against DDP (`dist.zero = 0`) on the CPU, over the TCP ring alone
# (the path of several hosts) and through shared memory (one host, with `shard_optimizer` off:
# the engine's stage 1, not shard_optimizer's shared-memory form): a dense BPR model of
# 1,800 x EMBED rows (tables not row-sparse, so their moments are sharded), at world 2 and 4.
# Per run: the estimate's optimizer and gradients terms and peak, the peak RSS each rank measured (the
# highest), the steady throughput, rank 0's update and collective time per step, the bytes a
# rank sent per step (the most of any rank), and test
# NDCG@10 (stages 1 and 2 must print DDP's).
#
# Usage: scripts/bench/zero.sh          (EMBED=32768 by default: 59M values; about 10 minutes here)
set -eu
cd "$(dirname "$0")/../.."
. scripts/bench/lib.sh
embed="${EMBED:-32768}"

zero_grid "0 1 2" \
  --set data.synthetic=\"small\" --set model.kind=\"bpr\" --set model.embedding_dim="$embed" \
  --set batch.global=2048

python3 - "$out" "$embed" <<'PY'
import sys
sys.path.insert(0, "scripts/bench")
import zero_runs
out, embed = sys.argv[1], sys.argv[2]
print("BPR, 1,800 x %s dense rows, one epoch" % embed)
print("| transport | world | dist.zero | optimizer term (estimate) MiB | gradients term (estimate) MiB | estimated peak MiB | measured peak RSS MiB | steady samples/s | update ms / step | collective ms / step | sent MiB / step | test NDCG@10 |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for transport, world, zero, mem, terms, summary, test in zero_runs.runs(out, (0, 1, 2)):
    steps = summary["steady_time_per_step_ms"]
    print("| %s | %d | %d | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f | %.0f | %.0f | %.4f |" % (
        transport, world, zero, terms["optimizer (AdamW)"], terms["gradients"], mem["estimate"]["peak_mib"],
        max(summary["peak_rss_mib"]), summary["steady_samples_per_s"],
        steps["update"], steps["collective"], max(summary["sent_mib_per_step"]),
        test["ndcg@10"]))
PY
