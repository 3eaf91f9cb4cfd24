#!/usr/bin/env bash
# Elastic re-forming on this machine: two `launch` processes as two nodes of 2 workers each
# (`--nnodes 1:2`, loopback) train bpr on full-size generated data (global 256, micro 64:
# world 4 takes grad_accum 1, world 2 grad_accum 2). In the middle of epoch 2 node 1's launcher
# is SIGKILLed; node 0 re-forms alone and finishes. Measured from the workers' sample traces
# (GPTREC_TRACE_SAMPLES, each step's wall time):
#   death -> first step  from the SIGKILL to the first optimizer step of the re-formed group
#                        (detection, teardown, rendezvous, worker start, resume, one step)
#   samples re-trained   steps taken after the checkpoint the group resumed from, times the
#                        global batch: work lost to the failure
# once with the default checkpoint cadence (end of each epoch) and once with
# checkpoint.every_n_steps = 500. Then a node that joins late: node 0 starts alone (after the
# 2 s last call), node 1 arrives in the middle of epoch 1; the group re-forms at the next
# checkpoint (nothing is re-trained):
#   arrival -> first step  from node 1's start to the first step of the 2-node group
# The peer: torchrun (PyTorch's, c10d rendezvous) with the same shape runs
# scripts/bench/elastic_peer.py (gloo, an all-reduce every 10 ms, nothing to load); node 1's
# agent is SIGKILLed and we wait up to PEER_WAIT seconds (default 60) for node 0's re-formed
# group to print its first step.
#
# Usage: scripts/bench/elastic.sh
set -eu
cd "$(dirname "$0")/../.."
. scripts/bench/lib.sh
export OMP_NUM_THREADS=1

node() { # name dir port every -> starts one node in the background, pid in $!
  local name=$1 dir=$2 port=$3 every=$4
  mkdir -p "$dir/trace"
  GPTREC_TRACE_SAMPLES="$dir/trace" "$launch" --nnodes 1:2 --num-processes 2 \
    --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "bench-$port" \
    --rdzv-conf last_call_timeout=2 --max-restarts 3 --grace-period 5 configs/default.toml \
    "${bpr_id[@]}" \
    --set run.output_dir=\""$dir"\" --set data.synthetic=\"full\" --set model.kind=\"bpr\" \
    --set train.epochs=2 --set eval.patience=0 --set batch.global=256 --set batch.micro=64 \
    --set checkpoint.every_n_steps="$every" >"$out/$name.log" 2>&1 &
}

# The last traced step of round 0 on rank 0 (0 if none yet).
last_step() {
  local s
  s=$(tail -n 1 "$1"/trace/trace-0-0.txt 2>/dev/null | cut -d' ' -f2)
  echo "${s:-0}"
}

# death_ms dir -> "<ms to first step of round 1> <steps re-trained>"
figures() {
  python3 - "$1" "$2" <<'PY'
import glob, sys
death, d = int(sys.argv[1]), sys.argv[2]
def rows(pattern):
    out = []
    for path in glob.glob(f"{d}/trace/{pattern}"):
        for line in open(path):
            e, s, t, _ = line.split(" ", 3)
            out.append((int(s), int(t)))
    return out
before, after = rows("trace-0-*.txt"), rows("trace-1-*.txt")
first = min(after)  # (step, time) of the re-formed group's first step
print(first[1] - death, max(s for s, _ in before) - (first[0] - 1))
PY
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now_ms() { python3 -c 'import time; print(int(time.time()*1000))'; }

steps_per_epoch=3000 # full-size generated data at global 256
echo "| checkpoints | death -> first step of the re-formed group | steps re-trained | samples re-trained |"
echo "|---|---|---|---|"
for every in 0 500; do
  dir="$out/kill-$every"
  port=$(free_port)
  node "kill-$every-0" "$dir" "$port" "$every"; host=$!
  sleep 0.5
  node "kill-$every-1" "$dir" "$port" "$every"; victim=$!
  # The middle of epoch 2, half-way between two 500-step checkpoints.
  until [ "$(last_step "$dir")" -ge $((steps_per_epoch * 3 / 2 + 250)) ]; do sleep 0.05; done
  death=$(now_ms)
  kill -9 "$victim"
  wait "$host" || { echo "node 0 failed: see $out/kill-$every-0.log" >&2; exit 1; }
  wait "$victim" 2>/dev/null || true
  read -r ms steps <<<"$(figures "$death" "$dir")"
  label=$([ "$every" = 0 ] && echo "end of each epoch (default)" || echo "every $every steps")
  echo "| $label | $(python3 -c "print(f'{$ms/1000:.2f} s')") | $steps | $((steps * 256)) |"
done
grep -h "world 4 -> 2" "$out"/kill-0-0.log | head -1

echo
echo "| late node | arrival -> first step of the larger group | steps re-trained |"
echo "|---|---|---|"
for every in 0 500; do
  dir="$out/join-$every"
  port=$(free_port)
  node "join-$every-0" "$dir" "$port" "$every"; host=$!
  until [ "$(last_step "$dir")" -ge $((steps_per_epoch / 2)) ]; do sleep 0.05; done
  arrival=$(now_ms)
  node "join-$every-1" "$dir" "$port" "$every"; late=$!
  wait "$host" || { echo "node 0 failed: see $out/join-$every-0.log" >&2; exit 1; }
  wait "$late" || { echo "node 1 failed: see $out/join-$every-1.log" >&2; exit 1; }
  read -r ms steps <<<"$(figures "$arrival" "$dir")"
  label=$([ "$every" = 0 ] && echo "checkpoints at the end of each epoch (default)" || echo "checkpoints every $every steps")
  echo "| $label | $(python3 -c "print(f'{$ms/1000:.2f} s')") | $steps |"
done
grep -h "world 2 -> 4" "$out"/join-0-0.log | head -1

echo
wait_s=${PEER_WAIT:-60}
port=$(free_port)
peer() { # name -> one torchrun agent in the background
  torchrun --nnodes 1:2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" \
    --rdzv-id "peer-$port" --max-restarts 3 scripts/bench/elastic_peer.py >"$out/$1.log" 2>&1 &
}
peer torchrun-0; agent0=$!
sleep 1
peer torchrun-1; agent1=$!
for _ in $(seq 1 240); do grep -q "FIRST_STEP.*world=4" "$out/torchrun-0.log" && break; sleep 0.5; done
sleep 2
death=$(now_ms)
kill -9 "$agent1"
result="no re-formed group within $wait_s s"
for _ in $(seq 1 $((wait_s * 10))); do
  line=$(grep -m1 "FIRST_STEP.*restart=1" "$out/torchrun-0.log" || true)
  if [ -n "$line" ]; then
    ts=$(echo "$line" | cut -d' ' -f2)
    result=$(python3 -c "print(f'{$ts - $death / 1000:.2f} s')")
    break
  fi
  sleep 0.1
done
kill "$agent0" 2>/dev/null || true
wait "$agent0" 2>/dev/null || true
pkill -f scripts/bench/elastic_peer.py 2>/dev/null || true
echo "torchrun (PyTorch $(python -c 'import torch; print(torch.__version__)' 2>/dev/null)), same kill: death -> first step of the re-formed group: $result"
