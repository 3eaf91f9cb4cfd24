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

# The ZeRO benchmarks' grid (zero.sh, zero3.sh): over the TCP ring alone (the path of several
# hosts) and through shared memory, at world 2 and 4, each stage of STAGES trains one epoch of
# configs/default.toml with dense tables and the model's SETS, as $out/TRANSPORT-wWORLD-zSTAGE
# (read back by zero_runs.py; ZERO_TRANSPORTS and ZERO_WORLDS narrow the grid):
# zero_grid "STAGES" SETS...
zero_grid() {
  local stages=$1 transport shm world zero
  shift
  for transport in ${ZERO_TRANSPORTS:-ring shm}; do
    shm=false; [ "$transport" = shm ] && shm=true
    for world in ${ZERO_WORLDS:-2 4}; do
      for zero in $stages; do
        launch_logged "$transport-w$world-z$zero" --num-processes "$world" --master-port 0 \
          configs/default.toml "${bpr_id[@]}" \
          --set run.output_dir=\""$out"\" --set run.name=\""$transport-w$world-z$zero"\" \
          --set checkpoint.resume=\"never\" --set eval.patience=0 --set train.epochs=1 \
          --set dist.shard_optimizer=false --set dist.shared_tables=false \
          --set dist.sparse_embeddings=false --set dist.shared_memory="$shm" --set dist.zero="$zero" \
          "$@"
      done
    done
  done
}
