#!/usr/bin/env bash
# ZeRO stage 3 (`dist.zero = 3`) against DDP and stages 1 and 2 on the CPU, on the model it is
# for: dynamic GPT-2 (the text tower trains; its blocks are the units gathered one at a time),
# with dense ID tables (`dist.sparse_embeddings = false`, so every parameter is sharded), over
# the TCP ring alone (the path of several hosts) and through shared memory, at world 2 and 4.
# Per run: the estimate's parameter terms and peak, the peak RSS each rank measured (the
# highest), the steady throughput, the bytes a rank sent per step (the most of any rank) and
# test NDCG@10 (every stage must print DDP's).
#
# Usage: scripts/bench/zero3.sh        (PRESET=tiny by default: the preset that trains here in
#                                       seconds; PRESET=gpt2 is the 124M one, hours on 2 cores)
set -eu
cd "$(dirname "$0")/../.."
. scripts/bench/lib.sh
preset="${PRESET:-tiny}"

for transport in ring shm; do
  shm=false; [ "$transport" = shm ] && shm=true
  for world in 2 4; do
  for zero in 0 1 2 3; do
    launch_logged "$transport-w$world-z$zero" --num-processes "$world" --master-port 0 configs/default.toml \
      "${bpr_id[@]}" \
      --set run.output_dir=\""$out"\" --set run.name=\""$transport-w$world-z$zero"\" \
      --set checkpoint.resume=\"never\" --set eval.patience=0 --set train.epochs=1 \
      --set data.synthetic=\"tiny\" --set model.text_mode=\"dynamic\" --set model.preset=\""$preset"\" \
      --set batch.global=256 --set batch.micro=64 \
      --set dist.shard_optimizer=false --set dist.shared_tables=false \
      --set dist.sparse_embeddings=false --set dist.shared_memory="$shm" --set dist.zero="$zero"
  done
  done
done

python3 - "$out" "$preset" <<'PY'
import json, os, sys
out, preset = sys.argv[1], sys.argv[2]
print("dynamic GPT-2 (%s preset), dense ID tables, one epoch of the tiny data, micro 64" % preset)
print("| transport | world | dist.zero | parameters term (estimate) MiB | gathered during a step (estimate) MiB | estimated peak MiB | measured peak RSS MiB | steady samples/s | sent MiB / step | test NDCG@10 |")
print("|---|---|---|---|---|---|---|---|---|---|")
for transport in ("ring", "shm"):
    for world in (2, 4):
        for zero in (0, 1, 2, 3):
            run = os.path.join(out, "%s-w%d-z%d" % (transport, world, zero))
            mem = json.load(open(os.path.join(run, "memory.json")))
            terms = {t["name"]: t["mib"] for t in mem["estimate"]["terms"]}
            recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
            summary = [r for r in recs if r["kind"] == "summary"][-1]
            test = [r for r in recs if r.get("split") == "test"][-1]
            print("| %s | %d | %d | %.1f | %.1f | %.1f | %.1f | %.0f | %.2f | %.4f |" % (
                transport, world, zero, terms["parameters"], terms.get("gathered parameters", 0.0),
                mem["estimate"]["peak_mib"], max(summary["peak_rss_mib"]),
                summary["steady_samples_per_s"], max(summary["sent_mib_per_step"]),
                test["ndcg@10"]))
PY
