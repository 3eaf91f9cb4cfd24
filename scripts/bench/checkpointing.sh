#!/usr/bin/env bash
# Activation checkpointing on GPT-2 small (124M, the `gpt2` preset), CPU: what a training step
# adds to a process's memory and how long it takes, with and without checkpointing, at several
# micro batches. Each setting runs in its own process (`gpt2-step-bench`: random weights, every
# weight trains, dropout on, the recommender's dynamic-mode shape: micro user texts + 2 x micro
# item texts of 32 tokens, 3 steps, the first not timed), so its peak RSS is its own. Next to the
# measurement: the memory estimate's GPT-2 gradients + activations for the same shape.
#
# Usage: scripts/bench/checkpointing.sh [MICRO ...]     (default 4 8 16; about 3 minutes here)
set -eu
cd "$(dirname "$0")/../.."
. scripts/setup.sh >&2 # its lines (a first install of torch, about 4 GB) on stderr, the figures on stdout
cargo build --release -p gptrec-worker --bin gpt2-step-bench >/dev/null 2>&1 \
  || cargo build --release -p gptrec-worker --bin gpt2-step-bench
bench="$PWD/target/release/gpt2-step-bench"
micros="${*:-4 8 16}"
results="$(mktemp)"
for m in $micros; do
  "$bench" --preset gpt2 --micro "$m" --tokens 32 --steps 3 >>"$results"
  "$bench" --preset gpt2 --micro "$m" --tokens 32 --steps 3 --checkpointing >>"$results"
done
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["micro"], {})[r["checkpointing"]] = r
def err(est, got):
    return "%+.0f%%" % ((est / got - 1) * 100)
print("| micro | added plain MiB (estimate) | added checkpointed MiB (estimate) | saved measured | saved estimate | s/step plain | s/step checkpointed |")
print("|---|---|---|---|---|---|---|")
for m in sorted(by):
    p, c = by[m][False], by[m][True]
    ep = p["estimate_gradients_mib"] + p["estimate_activations_mib"]
    ec = c["estimate_gradients_mib"] + c["estimate_activations_mib"]
    print("| %d | %.0f (%.0f, %s) | %.0f (%.0f, %s) | %.0f | %.0f | %.2f | %.2f (%+.0f%%) |" % (
        m, p["steps_added_mib"], ep, err(ep, p["steps_added_mib"]),
        c["steps_added_mib"], ec, err(ec, c["steps_added_mib"]),
        p["steps_added_mib"] - c["steps_added_mib"], ep - ec,
        p["seconds_per_step"], c["seconds_per_step"],
        (c["seconds_per_step"] / p["seconds_per_step"] - 1) * 100))
PY
rm -f "$results"
