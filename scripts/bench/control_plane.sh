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
# side's process start-up counts. Round trips per rank: requests
# after the handshake (TCPStore's multi_get counts two: its wait, then the get). Server memory:
# peak RSS (VmHWM); threads: the most seen, sampled every 20 ms. A size or side that fails or
# runs past LIMIT_S is killed, reported as failed / timeout, and the script goes on.
#
# PyTorch's client looks up the DNS name of the store's address, ::ffff:127.0.0.1, for every
# connection it opens (and every wait that times out); where DNS is slow or drops queries (a
# sandbox; the script prints a note) that wait dominates its figures. So, by default where it
# runs as root with unshare (LOOPBACK_HOSTS=auto; 1 forces it, 0 leaves it off), it answers
# that look-up from a private copy of /etc/hosts in a mount namespace of the script's own
# (nothing outside changes), as a cluster's /etc/hosts or name cache would.
#
# Usage: [SIZES="64 512 2048 8192"] [PROCS=4] [THREADS=16] [LOCAL=8] [LIMIT_S=120] \
#        [LOOPBACK_HOSTS=auto] scripts/bench/control_plane.sh
set -eu
cd "$(dirname "$0")/../.."
. scripts/setup.sh >/dev/null
cargo build --release -p gptrec-store --bins >/dev/null 2>&1 || cargo build --release -p gptrec-store --bins
sizes="${SIZES:-64 512 2048 8192}"
local_ranks="${LOCAL:-8}"

# Descriptors: a server holds one per connection (N + N/L) and a rank process its share of
# them, plus slack.
largest=0
for n in $sizes; do [ "$n" -gt "$largest" ] && largest=$n; done
want=$((largest + largest / local_ranks + 256))
hard="$(ulimit -Hn)"
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt "$want" ]; then
  if [ "$hard" = unlimited ] || [ "$hard" -ge "$want" ]; then
    ulimit -n "$want"
  else
    ulimit -n "$hard"
    echo "bench: ulimit -n is $hard at most here (hard limit), short of the $want that N=$largest needs; larger sizes may fail"
  fi
fi

echo "bench: sizes $sizes, $local_ranks ranks per host, ${PROCS:-4} processes x ${THREADS:-16} threads, limit ${LIMIT_S:-120} s, ulimit -n $(ulimit -n)"
orchestrate() {
  SIZES="$sizes" LOCAL="$local_ranks" python3 scripts/bench/control_plane.py \
    "$PWD/target/release/control-plane-bench" "$PWD/scripts/bench/control_plane_tcpstore.py"
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
  export sizes local_ranks
  echo "bench: LOOPBACK_HOSTS=1: ::ffff:127.0.0.1 is named from a private /etc/hosts"
  unshare -m bash -c 'mount --bind "$0" /etc/hosts && orchestrate' "$hosts"
else
  orchestrate
fi
