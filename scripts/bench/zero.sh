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

for transport in ring shm; do
  shm=false; [ "$transport" = shm ] && shm=true
  for world in 2 4; do
  for zero in 0 1 2; do
    launch_logged "$transport-w$world-z$zero" --num-processes "$world" --master-port 0 configs/default.toml \
      "${bpr_id[@]}" \
      --set run.output_dir=\""$out"\" --set run.name=\""$transport-w$world-z$zero"\" \
      --set checkpoint.resume=\"never\" --set eval.patience=0 --set train.epochs=1 \
      --set data.synthetic=\"small\" --set model.kind=\"bpr\" --set model.embedding_dim="$embed" \
      --set batch.global=2048 \
      --set dist.shard_optimizer=false --set dist.shared_tables=false \
      --set dist.sparse_embeddings=false --set dist.shared_memory="$shm" --set dist.zero="$zero"
  done
  done
done

python3 - "$out" "$embed" <<'PY'
import json, os, sys
out, embed = sys.argv[1], sys.argv[2]
print("BPR, 1,800 x %s dense rows, one epoch" % embed)
print("| transport | world | dist.zero | optimizer term (estimate) MiB | gradients term (estimate) MiB | estimated peak MiB | measured peak RSS MiB | steady samples/s | update ms / step | collective ms / step | sent MiB / step | test NDCG@10 |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for transport in ("ring", "shm"):
    for world in (2, 4):
        for zero in (0, 1, 2):
            run = os.path.join(out, "%s-w%d-z%d" % (transport, world, zero))
            mem = json.load(open(os.path.join(run, "memory.json")))
            terms = {t["name"]: t["mib"] for t in mem["estimate"]["terms"]}
            recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
            summary = [r for r in recs if r["kind"] == "summary"][-1]
            test = [r for r in recs if r.get("split") == "test"][-1]
            steps = summary["steady_time_per_step_ms"]
            print("| %s | %d | %d | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f | %.0f | %.0f | %.4f |" % (
                transport, world, zero, terms["optimizer (AdamW)"], terms["gradients"], mem["estimate"]["peak_mib"],
                max(summary["peak_rss_mib"]), summary["steady_samples_per_s"],
                steps["update"], steps["collective"], max(summary["sent_mib_per_step"]),
                test["ndcg@10"]))
PY
