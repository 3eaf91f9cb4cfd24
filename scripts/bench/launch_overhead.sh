#!/usr/bin/env bash
# Start-up and teardown of `launch` against the spawn floor and torchrun, measured in one run,
# interleaved (every variant in every round), by one timing harness for all of them.
#
#   start-up:  wall time of `launch --num-processes 2 -- /bin/true` (and with `--no-pin`)
#              vs the spawn floor, `sh -c '/bin/true & /bin/true & wait'` (a shell that starts
#              two /bin/true and waits for them), and
#              `torchrun --standalone --no-python --nproc-per-node 2 /bin/true`
#   teardown:  rank 1 records the time and exits 1; the other workers exit on SIGTERM;
#              time from that failure to the launcher's exit, for both launchers.
#
# Usage: scripts/bench/launch_overhead.sh [RUNS]   (rounds, default 7; prints medians)
#   LAUNCH_BENCH_NO_TORCHRUN=1   leave torchrun out (about 3 s a run; for quick iterations)
set -eu
cd "$(dirname "$0")/../.."
runs="${1:-7}"
. scripts/setup.sh >&2 # its lines (a first install of torch, about 4 GB) on stderr, the figures on stdout
cargo build --release -p gptrec-launcher >/dev/null 2>&1 || cargo build --release -p gptrec-launcher
launch="$PWD/target/release/launch"
torchrun="$(command -v torchrun)"
[ "${LAUNCH_BENCH_NO_TORCHRUN:-0}" = 1 ] && torchrun=""
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# A worker for the teardown runs: rank 1 fails after 1 s; the others wait, and exit on SIGTERM.
cat >"$tmp/worker.sh" <<'W'
#!/bin/sh
if [ "$RANK" = 1 ]; then sleep 1; date +%s%N > "$FAIL_AT"; exit 1; fi
trap 'exit 143' TERM
sleep 60 & wait
W
chmod +x "$tmp/worker.sh"

echo "bench: $runs rounds (start-up: 2 x /bin/true, 5 runs a round of each, torchrun 1; teardown: 3 workers, rank 1 fails, 1 run a round)"
# The timing harness: the wall time around each program's whole run (started to reaped), with
# the same clock, the same start (Python's subprocess, close_fds) and the same output
# (/dev/null) for every variant; medians in ms.
python3 - "$runs" "$launch" "$torchrun" "$tmp" <<'PY'
import os, statistics, subprocess, sys, time

runs, launch, torchrun, tmp = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
start = {
    "launch": [launch, "--num-processes", "2", "--master-port", "0", "--", "/bin/true"],
    "launch --no-pin": [launch, "--num-processes", "2", "--master-port", "0", "--no-pin",
                        "--", "/bin/true"],
    "sh": ["sh", "-c", "/bin/true & /bin/true & wait"],
}
down = {"launch": [launch, "--num-processes", "3", "--master-port", "0", "--",
                   f"{tmp}/worker.sh"]}
if torchrun:
    start["torchrun"] = [torchrun, "--standalone", "--no-python", "--nproc-per-node", "2",
                         "/bin/true"]
    down["torchrun"] = [torchrun, "--standalone", "--no-python", "--nproc-per-node", "3",
                        f"{tmp}/worker.sh"]
env = dict(os.environ, FAIL_AT=f"{tmp}/fail")

def run(argv):
    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, close_fds=True, env=env)

def wall_ms(argv):
    t0 = time.perf_counter_ns()
    run(argv)
    return (time.perf_counter_ns() - t0) / 1e6

def teardown_ms(argv):
    run(argv)
    ended = time.time_ns()
    with open(f"{tmp}/fail") as f:
        return (ended - int(f.read())) / 1e6

# Each round: the millisecond start-ups 5 times each, in turn (the order rotating, after one
# unmeasured run each: the round's torchrun and teardown runs leave caches cold), then
# torchrun's start-up and both teardowns once.
quick = [name for name in start if name != "torchrun"]
times = {name: [] for name in start}
downs = {name: [] for name in down}
for r in range(runs):
    for name in quick:
        run(start[name])
    for k in range(5):
        for i in range(len(quick)):
            name = quick[(i + k + r) % len(quick)]
            times[name].append(wall_ms(start[name]))
    if torchrun:
        times["torchrun"].append(wall_ms(start["torchrun"]))
    for name, argv in down.items():
        downs[name].append(teardown_ms(argv))

med = {name: statistics.median(v) for name, v in times.items()}
floor = med["sh"]
tr = f"{med['torchrun']:.1f} ms" if torchrun else "skipped"
print(f"start-up (median wall, 2 x /bin/true): launch {med['launch']:.2f} ms, "
      f"sh (spawn floor) {floor:.2f} ms, ratio {med['launch'] / floor:.2f}x, torchrun {tr}")
print(f"start-up with --no-pin:                launch {med['launch --no-pin']:.2f} ms, "
      f"ratio {med['launch --no-pin'] / floor:.2f}x")
td = {name: statistics.median(v) for name, v in downs.items()}
tr = f"{td['torchrun']:.1f} ms" if torchrun else "skipped"
print(f"teardown (median, failure -> launcher exit): launch {td['launch']:.1f} ms, torchrun {tr}")
PY
