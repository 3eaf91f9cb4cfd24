#!/usr/bin/env bash
# Start-up and teardown of `launch` against torchrun, measured in one run, alternating.
#
#   start-up:  wall time of `launch --num-processes 2 -- /bin/true`
#              vs `torchrun --standalone --no-python --nproc-per-node 2 /bin/true`
#   teardown:  rank 1 records the time and exits 1; the other workers exit on SIGTERM;
#              time from that failure to the launcher's exit, for both launchers.
#
# Usage: scripts/bench/launch_overhead.sh [RUNS]   (default 7; prints medians)
set -eu
cd "$(dirname "$0")/../.."
runs="${1:-7}"
. scripts/setup.sh >/dev/null
cargo build --release -p gptrec-launcher >/dev/null 2>&1 || cargo build --release -p gptrec-launcher
launch="$PWD/target/release/launch"
torchrun="$(command -v torchrun)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

now_ns() { date +%s%N; }
median() { sort -n | awk '{a[NR]=$1} END {m=(NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2; printf "%.1f", m}'; }

# A worker for the teardown runs: rank 1 fails after 1 s; the others wait, and exit on SIGTERM.
cat >"$tmp/worker.sh" <<'W'
#!/bin/sh
if [ "$RANK" = 1 ]; then sleep 1; date +%s%N > "$FAIL_AT"; exit 1; fi
trap 'exit 143' TERM
sleep 60 & wait
W
chmod +x "$tmp/worker.sh"

: >"$tmp/launch_start"; : >"$tmp/torchrun_start"; : >"$tmp/launch_down"; : >"$tmp/torchrun_down"
echo "bench: $runs alternating runs each (start-up: 2 x /bin/true; teardown: 3 workers, rank 1 fails)"
for i in $(seq "$runs"); do
  t0=$(now_ns); "$launch" --num-processes 2 --master-port 0 -- /bin/true >/dev/null 2>&1; t1=$(now_ns)
  echo $(( (t1 - t0) / 1000 )) >>"$tmp/launch_start"
  t0=$(now_ns); "$torchrun" --standalone --no-python --nproc-per-node 2 /bin/true >/dev/null 2>&1; t1=$(now_ns)
  echo $(( (t1 - t0) / 1000 )) >>"$tmp/torchrun_start"

  FAIL_AT="$tmp/fail" "$launch" --num-processes 3 --master-port 0 -- "$tmp/worker.sh" >/dev/null 2>&1 || true
  t1=$(now_ns); echo $(( (t1 - $(cat "$tmp/fail")) / 1000 )) >>"$tmp/launch_down"
  FAIL_AT="$tmp/fail" "$torchrun" --standalone --no-python --nproc-per-node 3 "$tmp/worker.sh" >/dev/null 2>&1 || true
  t1=$(now_ns); echo $(( (t1 - $(cat "$tmp/fail")) / 1000 )) >>"$tmp/torchrun_down"
done

ls_us=$(median <"$tmp/launch_start"); ts_us=$(median <"$tmp/torchrun_start")
ld_us=$(median <"$tmp/launch_down"); td_us=$(median <"$tmp/torchrun_down")
awk -v ls="$ls_us" -v ts="$ts_us" -v ld="$ld_us" -v td="$td_us" 'BEGIN {
  printf "start-up  (median wall, 2 x /bin/true):   launch %8.1f ms   torchrun %8.1f ms   ratio 1/%.0f\n", ls/1000, ts/1000, ts/ls
  printf "teardown  (failure -> launcher exit):     launch %8.1f ms   torchrun %8.1f ms\n", ld/1000, td/1000
}'
