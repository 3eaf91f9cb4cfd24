#!/usr/bin/env bash
# ZeRO under a memory cgroup, as a container, a Slurm job's --mem or a Kubernetes pod limits a
# job: 2 ranks over the TCP ring on the model of scripts/bench/zero.sh (BPR, 1,800 x EMBED dense
# rows), each in a fresh cgroup. First DDP and stage 1 where the limit does not bind, for what
# the cgroup charges each; then, under a limit halfway between the two (or LIMIT_MB), DDP
# (dist.zero = 0), which the kernel's OOM killer should stop, and dist.zero = "auto", which
# plans with the cgroup's limit, takes stage 1 and should finish with DDP's loss and NDCG@10.
# Then stage 2 where the limit does not bind, and under a limit halfway between stage 1's and
# stage 2's charges (or LIMIT2_MB) stage 1, which should be stopped, and stage 2, which should
# finish with DDP's loss (chosen by hand: the estimate does not promise stage 2 less here).
# Needs root and a memory controller (cgroup v1, or v2 with memory enabled at its root).
#
# Usage: scripts/bench/zero_cgroup.sh   (EMBED=32768 by default; about 6 minutes)
set -eu
cd "$(dirname "$0")/../.."
. scripts/bench/lib.sh
embed="${EMBED:-32768}"

if [ -f /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then
  root=/sys/fs/cgroup/memory limit_file=memory.limit_in_bytes peak_file=memory.max_usage_in_bytes
elif grep -qw memory /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null; then
  root=/sys/fs/cgroup limit_file=memory.max peak_file=memory.peak
else
  echo "no memory controller to make a cgroup under (root and cgroup v1 or v2's memory needed)" >&2
  exit 1
fi
made=()
trap 'for d in "${made[@]}"; do rmdir "$d" 2>/dev/null || true; done' EXIT

sets=(--set run.output_dir=\""$out"\" --set checkpoint.resume=\"never\" --set eval.patience=0
  --set train.epochs=1 --set data.synthetic=\"small\" --set model.kind=\"bpr\"
  "${bpr_id[@]}"
  --set model.embedding_dim="$embed" --set batch.global=2048 --set dist.shard_optimizer=false
  --set dist.shared_tables=false --set dist.sparse_embeddings=false --set dist.shared_memory=false)

# NAME ZERO LIMIT_MB: one run in a fresh cgroup limited to LIMIT_MB; its exit code and the
# cgroup's peak charge (MiB) are kept in $out/NAME.code and $out/NAME.peak.
run() {
  local name=$1 zero=$2 limit=$3
  local cg="$root/gptrec-bench-$$-$name"
  mkdir "$cg" && made+=("$cg")
  echo $((limit << 20)) >"$cg/$limit_file"
  set +e
  sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$cg" "$launch" --num-processes 2 \
    --master-port 0 configs/default.toml "${sets[@]}" --set run.name=\""$name"\" \
    --set dist.zero="$zero" >"$out/$name.log" 2>&1
  echo $? >"$out/$name.code"
  set -e
  echo $(($(cat "$cg/$peak_file") >> 20)) >"$out/$name.peak"
}

# What each takes without a limit that binds (the cgroup's own count: shared library pages
# cached before are not charged to it, so it is below the sum of the ranks' RSS).
run free-ddp 0 65536
run free-zero1 1 65536
limit_mb="${LIMIT_MB:-$((($(cat "$out/free-ddp.peak") + $(cat "$out/free-zero1.peak")) / 2))}"
run cg-ddp 0 "$limit_mb"
run cg-auto '"auto"' "$limit_mb"
run free-zero2 2 65536
limit2_mb="${LIMIT2_MB:-$((($(cat "$out/free-zero1.peak") + $(cat "$out/free-zero2.peak")) / 2))}"
run cg2-zero1 1 "$limit2_mb"
run cg2-zero2 2 "$limit2_mb"

python3 - "$out" "$limit_mb" "$limit2_mb" <<'PY'
import json, os, sys
out, limit, limit2 = sys.argv[1], sys.argv[2], sys.argv[3]
print("2 ranks over the TCP ring, BPR 1,800 x 32,768 dense rows")
print("| run | cgroup limit MiB | cgroup peak MiB | exit code | stage | peak RSS per rank MiB | last loss | test NDCG@10 | how it ended |")
print("|---|---|---|---|---|---|---|---|---|")
for name in ("free-ddp", "free-zero1", "cg-ddp", "cg-auto", "free-zero2", "cg2-zero1", "cg2-zero2"):
    code = open(os.path.join(out, name + ".code")).read().strip()
    peak = open(os.path.join(out, name + ".peak")).read().strip()
    cap = "65536" if name.startswith("free") else (limit2 if name.startswith("cg2") else limit)
    log = open(os.path.join(out, name + ".log")).read()
    stage, rss, loss, ndcg, ended = "0", "", "", "", "finished"
    if "ZeRO stage 1 (dist.zero = 1)" in log:
        stage = "1"
    if "ZeRO stage 2 (dist.zero = 2)" in log:
        stage = "2"
    if '"auto": stage' in log:
        stage += " (auto)"
    path = os.path.join(out, name, "metrics.jsonl")
    recs = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    summary = [r for r in recs if r.get("kind") == "summary"]
    test = [r for r in recs if r.get("split") == "test"]
    if summary:
        rss = ", ".join("%.0f" % m for m in summary[-1]["peak_rss_mib"])
        loss = "%.4f" % summary[-1]["last_loss"]
    if test:
        ndcg = "%.4f" % test[-1]["ndcg@10"]
    if code != "0":
        lines = [l for l in log.splitlines() if "root cause" in l]
        ended = (lines[0].strip() if lines else "failed")[:120]
    print("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
        name, cap, peak, code, stage, rss, loss, ndcg, ended))
PY
