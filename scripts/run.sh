#!/usr/bin/env bash
# The main job on the built-in default: set up (once), build, and run
# `launch --num-processes 2 configs/default.toml` (a small CPU run). Extra arguments go to launch,
# e.g. `scripts/run.sh --dry-run`.
set -eu
cd "$(dirname "$0")/.."
. scripts/setup.sh
echo "run: cargo build --release"
cargo build --release --workspace
echo "run: target/release/launch --num-processes 2 configs/default.toml $*"
exec target/release/launch --num-processes 2 "$@" configs/default.toml
