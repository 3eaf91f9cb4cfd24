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

zero_grid "0 1 2 3" \
  --set data.synthetic=\"tiny\" --set model.text_mode=\"dynamic\" --set model.preset=\""$preset"\" \
  --set batch.global=256 --set batch.micro=64

python3 - "$out" "$preset" <<'PY'
import sys
sys.path.insert(0, "scripts/bench")
import zero_runs
out, preset = sys.argv[1], sys.argv[2]
print("dynamic GPT-2 (%s preset), dense ID tables, one epoch of the tiny data, micro 64" % preset)
print("| transport | world | dist.zero | parameters term (estimate) MiB | gathered during a step (estimate) MiB | estimated peak MiB | measured peak RSS MiB | steady samples/s | sent MiB / step | test NDCG@10 |")
print("|---|---|---|---|---|---|---|---|---|---|")
for transport, world, zero, mem, terms, summary, test in zero_runs.runs(out, (0, 1, 2, 3)):
    print("| %s | %d | %d | %.1f | %.1f | %.1f | %.1f | %.0f | %.2f | %.4f |" % (
        transport, world, zero, terms["parameters"], terms.get("gathered parameters", 0.0),
        mem["estimate"]["peak_mib"], max(summary["peak_rss_mib"]),
        summary["steady_samples_per_s"], max(summary["sent_mib_per_step"]),
        test["ndcg@10"]))
PY
