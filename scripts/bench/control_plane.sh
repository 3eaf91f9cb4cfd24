#!/usr/bin/env bash
# The control plane at scale: the store traffic of a job's start-up (rendezvous, the start-up
# agreement, the tcp ring's secret / nonces / addresses, shared memory within each host, the
# host verdicts and the leaders' ring: store/src/bin/control_plane_bench/traffic.rs) for N
# simulated ranks, L per host, against our store and against PyTorch's TCPStore (libuv server,
# scripts/bench/control_plane_tcpstore.py replays the same rounds), in the same script run,
# interleaved (ours then TCPStore for each N).
#
# For each N and side: a server, then PROCS rank processes started at once, each driving N/PROCS
# ranks with THREADS threads (one connection per rank, a second one per host leader; ours
# connect from one loopback address per host, 127.1.x.y, since our server limits unproven
# connections per address; PyTorch's client cannot choose its source and its server has no such
# limit). Every rank process starts, reads its arguments (Python imports torch) and says it is
# ready; then all are given the start line at once (scripts/bench/control_plane.py). The time:
# from that line to the last simulated rank's end of set-up, its connections closed, so neither
# side's process start-up counts. Requests per rank: after the handshake (writes are
# requests without an answer on both sides; TCPStore's multi_get counts two: its wait, then the get). Server memory:
# peak RSS (VmHWM); threads: the most seen, sampled every 20 ms. A size or side that fails or
# runs past LIMIT_S is killed, reported as failed / timeout, and the script goes on.
#
# Detection (ours only): after the set-up rounds, our rank processes keep their connections and
# every simulated rank leaves its will on one more connection and parks in a wait for
# job/failed there (runtime/src/job_watch.rs; store/src/bin/control_plane_bench/watch.rs); rank
# N/2's watching connection is closed, as its death would, and the figure is the time from that
# to the last of the other N-1 ranks' waits answered with that rank's line (checked). TCPStore
# has no wills (a connection's end writes nothing), so its column is "n/a": a real job on it
# learns of a death only from a collective's timeout or the launcher's monitor. The server's
# peak memory in the table is still the set-up's; with the watches it is in the details.
#
# PyTorch's client looks up the DNS name of the store's address, ::ffff:127.0.0.1, for every
# connection it opens (and every wait that times out); where DNS is slow or drops queries (a
# sandbox; the script prints a note) that wait dominates its figures. So, by default where it
# runs as root with unshare (LOOPBACK_HOSTS=auto; 1 forces it, 0 leaves it off), it answers
# that look-up from a private copy of /etc/hosts in a mount namespace of the script's own
# (nothing outside changes), as a cluster's /etc/hosts or name cache would.
#
# The elastic rows (ELASTIC="16 128 1024" by default; ELASTIC="" skips them): for each M, a real
# host `launch --nnodes M:M+1 --rdzv-endpoint 127.0.0.1:P -- sleep 3600` (its rendezvous store
# and coordinator) and M simulated launchers in one process (`control-plane-bench launchers`,
# ELASTIC_THREADS=8 threads; store/src/bin/control_plane_bench/elastic.rs re-codes the
# launcher's side of launcher/src/rendezvous.rs request for request) heartbeating and polling at
# the real cadence, each from its own loopback address (127.2.x.y). The time to form the first
# round (all M + 1), from one simulated launcher's death (its connections closed at once) to its
# detection (`elastic/r0/failed`) and to the next round (the M left), and the host's CPU and
# memory while that round runs (the simulator's own CPU is shown beside it). SIZES="" runs only
# these rows.
#
# Usage: [SIZES="64 512 2048 8192"] [PROCS=4] [THREADS=16] [LOCAL=8] [LIMIT_S=120] \
#        [LOOPBACK_HOSTS=auto] [ELASTIC="16 128 1024"] [ELASTIC_THREADS=8] \
#        scripts/bench/control_plane.sh
set -eu
cd "$(dirname "$0")/../.."
. scripts/setup.sh >&2 # its lines (a first install of torch, about 4 GB) on stderr, the figures on stdout
cargo build --release -p gptrec-store --bins >/dev/null 2>&1 || cargo build --release -p gptrec-store --bins
elastic="${ELASTIC-16 128 1024}"
if [ -n "$elastic" ]; then
  cargo build --release -p gptrec-launcher >/dev/null 2>&1 || cargo build --release -p gptrec-launcher
fi
sizes="${SIZES-64 512 2048 8192}"
local_ranks="${LOCAL:-8}"

# Descriptors: a server holds one per connection (N + N/L for the set-up, N more for the
# detection phase's watches: 2N + N/L) and a rank process its share of them, plus slack.
largest=0
for n in $sizes; do [ "$n" -gt "$largest" ] && largest=$n; done
want=$((2 * largest + largest / local_ranks + 256))
# An elastic row: the host holds about 3 connections per simulated launcher (main, heartbeat,
# join or monitor), and so does the simulator.
for m in $elastic; do [ $((3 * m + 256)) -gt "$want" ] && want=$((3 * m + 256)); done
hard="$(ulimit -Hn)"
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt "$want" ]; then
  if [ "$hard" = unlimited ] || [ "$hard" -ge "$want" ]; then
    ulimit -n "$want"
  else
    ulimit -n "$hard"
    echo "bench: ulimit -n is $hard at most here (hard limit), short of the $want that N=$largest needs; larger sizes may fail"
  fi
fi

echo "bench: sizes ${sizes:-none}, $local_ranks ranks per host, ${PROCS:-4} processes x ${THREADS:-16} threads, limit ${LIMIT_S:-120} s, elastic ${elastic:-none}, ulimit -n $(ulimit -n)"
orchestrate() {
  SIZES="$sizes" LOCAL="$local_ranks" ELASTIC="$elastic" python3 scripts/bench/control_plane.py \
    "$PWD/target/release/control-plane-bench" "$PWD/scripts/bench/control_plane_tcpstore.py" \
    "$PWD/target/release/launch"
}
loopback="${LOOPBACK_HOSTS:-auto}"
if [ "$loopback" = auto ]; then
  loopback=0
  if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null 2>&1; then loopback=1; fi
fi
if [ "$loopback" = 1 ]; then
  # PyTorch's client looks up the name of ::ffff:127.0.0.1 for every connection it opens;
  # where DNS is slow or drops queries, answer it from a private copy of /etc/hosts, in a mount
  # namespace of the benchmark's own (root; nothing outside it changes).
  hosts="$(mktemp)"
  trap 'rm -f "$hosts"' EXIT
  { cat /etc/hosts; echo '::ffff:127.0.0.1 localhost'; } >"$hosts"
  export -f orchestrate
  export sizes local_ranks elastic
  echo "bench: LOOPBACK_HOSTS=1: ::ffff:127.0.0.1 is named from a private /etc/hosts"
  unshare -m bash -c 'mount --bind "$0" /etc/hosts && orchestrate' "$hosts"
else
  orchestrate
fi
