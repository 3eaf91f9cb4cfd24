# Sourced by the benchmarks from the repository root: the set-up, a release build, $launch (the
# built launcher) and $out (BENCH_OUT, or a fresh temporary folder) where the runs go.
. scripts/setup.sh >&2 # its lines (a first install of torch, about 4 GB) on stderr, the figures on stdout
cargo build --release --workspace >/dev/null 2>&1 || cargo build --release --workspace
launch="$PWD/target/release/launch"
out="${BENCH_OUT:-$(mktemp -d)}"
mkdir -p "$out"
echo "runs in $out"

. scripts/bench/summary.sh

# The model the benchmarks on configs/default.toml measured and the PyTorch peers implement:
# BPR with an ID row per user (the default itself ships the softmax over the pooled history).
# Scripts that may run without this file (vs_pytorch_gpt2.sh with GPTREC_BIN, ab_builds.sh,
# slurm_start.sh, scripts/gpu/check.sh) spell the same two settings out.
bpr_id=(--set 'train.loss="bpr"' --set 'model.user_tower="id"')

# Runs the launcher with its output in $out/NAME.log; on failure says so with the log's tail:
# launch_logged NAME ARGS...
launch_logged() {
  local name=$1
  shift
  if ! "$launch" "$@" >"$out/$name.log" 2>&1; then
    echo "$name failed: see $out/$name.log" >&2
    tail -5 "$out/$name.log" >&2
    return 1
  fi
}
