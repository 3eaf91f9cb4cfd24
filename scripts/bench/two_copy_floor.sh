#!/usr/bin/env bash
# What bounds a shared-memory broadcast of 64 MiB from private memory on this machine: the C
# program two_copy_floor.c (two processes, one per core, passing 64 MiB through double buffers
# in shared memory, nothing else) at chunks of 64 KiB to 1 MiB and 2 to 8 buffers, then ours
# (`collective-bench --op broadcast`, shared memory and socket ring) right after, ROUNDS times
# (default 2), so that the floor and ours see the same minute of this machine.
#
# Usage: [ROUNDS=2] scripts/bench/two_copy_floor.sh
set -eu
cd "$(dirname "$0")/../.."
. scripts/setup.sh >&2 # its lines (a first install of torch, about 4 GB) on stderr, the figures on stdout
cargo build --release -p gptrec-launcher -p gptrec-worker >/dev/null 2>&1 || cargo build --release -p gptrec-launcher -p gptrec-worker
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cc -O2 -msse2 -o "$tmp/two_copy_floor" scripts/bench/two_copy_floor.c
for round in $(seq "${ROUNDS:-2}"); do
  echo "round $round"
  for kib in 64 256 1024; do
    for nbuf in 2 4 8; do
      "$tmp/two_copy_floor" "$kib" "$nbuf"
    done
  done
  for how in "" --sockets; do
    target/release/launch --num-processes 2 --master-port 0 -- \
      target/release/collective-bench --op broadcast $how 64 2>&1 | sed -n -E 's/^\[rank 0\] //p'
  done
done
