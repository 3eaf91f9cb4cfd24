#!/usr/bin/env bash
# Every test: set up (once), build the binaries the end-to-end tests run, then run all unit and
# end-to-end tests. CI runs exactly this (.ci/run). Extra arguments go to `cargo test`.
set -eu
cd "$(dirname "$0")/.."
. scripts/setup.sh
echo "test: cargo build --release --workspace"
cargo build --release --workspace
echo "test: cargo test --release --workspace"
exec cargo test --release --workspace "$@"
