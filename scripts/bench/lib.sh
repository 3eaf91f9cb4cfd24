# Sourced by the benchmarks from the repository root: the set-up, a release build, $launch (the
# built launcher) and $out (BENCH_OUT, or a fresh temporary folder) where the runs go.
. scripts/setup.sh >/dev/null
cargo build --release --workspace >/dev/null 2>&1 || cargo build --release --workspace
launch="$PWD/target/release/launch"
out="${BENCH_OUT:-$(mktemp -d)}"
mkdir -p "$out"
echo "runs in $out"
