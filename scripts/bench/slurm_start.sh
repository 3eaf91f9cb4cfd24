#!/usr/bin/env bash
# Start-up under Slurm: how long from `sbatch` to the first training step, against the same
# run started by hand, and launch's own share of it. On a fresh 2-node minicluster on this
# machine (tests/slurm/minicluster.sh; needs root, slurm-wlm and munge), tiny config (bpr on
# synthetic "tiny" data, 1 epoch), 2 nodes x 2 processes, alternating, RUNS times:
#
#   slurm:    `sbatch -N2 scripts/slurm/train.sbatch ... --num-processes 2` -> the first
#             `epoch 1/1 step` line in logs/slurm-<job>/rank-0.log (polled every 10 ms)
#   by hand:  two `launch --nnodes 2 --node-rank R --master-addr 127.0.0.1 --master-port P
#             --run-id X --num-processes 2 ...` started together -> the same line
#   launch's share, in one 2-node job: `srun -N2 launch --num-processes 2 -- /bin/true`
#             against `srun -N2 /bin/true`, and `srun -N2 launch --dry-run CONFIG` (validate the
#             config, plan the batch, estimate memory: everything launch does before it spawns)
#
# One untimed job runs first (a fresh cluster's first job also waits for the nodes to finish
# registering). The minicluster schedules with batch_sched_delay=0 (Slurm's default delays
# batch jobs up to 3 s); its scheduler still starts a job up to ~1 s after submission.
#
# Usage: scripts/bench/slurm_start.sh [RUNS]   (default: $RUNS or 5; prints medians in ms)
# Uses target/release/{launch,worker} (builds them when missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
runs=${1:-${RUNS:-5}}
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "slurm_start: RUNS must be a positive number" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "slurm_start: needs root (it starts a Slurm cluster)" >&2; exit 2; }
PATH="$PATH:/usr/sbin:/sbin"
for c in slurmctld slurmd munged sbatch srun squeue; do
  command -v "$c" >/dev/null || { echo "slurm_start: $c missing (apt-get install -y --no-install-recommends slurm-wlm munge)" >&2; exit 2; }
done
if [ ! -x target/release/launch ] || [ ! -x target/release/worker ]; then
  cargo build --release --workspace
fi
launch=$repo/target/release/launch
# This script's own processes stay outside any Slurm job it may run in.
while read -r v; do unset "$v"; done < <(env | sed -n 's/^\(\(SLURM\|SBATCH\|SRUN\|SALLOC\|PET\)_[A-Za-z0-9_]*\)=.*/\1/p; s/^\(LAUNCH_RUN_ID\)=.*/\1/p')

tmp=$(mktemp -d /tmp/slurm-start-bench.XXXXXX)
cluster=$tmp/cluster
mc=$repo/tests/slurm/minicluster.sh
cleanup() {
  local p
  for p in $(jobs -p); do kill "$p" 2>/dev/null || true; done
  if [ -f "$cluster/pids" ]; then bash "$mc" stop "$cluster" >/dev/null 2>&1 || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

now_us() { echo "${EPOCHREALTIME/./}"; }
median() { sort -n | awk '{a[NR]=$1} END {if (NR == 0) {print "nan"; exit} m=(NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2; printf "%.0f", m}'; }
minmax() { sort -n | awk 'NR==1{lo=$1} {hi=$1} END {printf "%.0f %.0f", lo, hi}'; }
fail() { echo "slurm_start: $*" >&2; exit 1; }

# --- a fresh 2-node cluster on free ports ---
started=0
for base in $(seq 61000 8 61400); do
  rc=0
  MC_PORT=$base MC_CPUS=4 bash "$mc" start "$cluster" 2 >"$tmp/mc.log" 2>&1 || rc=$?
  if [ $rc = 0 ]; then started=1; break; fi
  [ $rc = 3 ] || { cat "$tmp/mc.log" >&2; fail "could not start the minicluster"; }
done
[ $started = 1 ] || fail "no free ports for the minicluster in 61000-61407"
conf=$cluster/etc/slurm.conf
slurm() { SLURM_CONF=$conf "$@"; }

# One untimed job first: the cluster's first job also pays for nodes finishing registration.
slurm sbatch --wait -N2 -o /dev/null --wrap 'srun -N2 /bin/true' >/dev/null || fail "the warm-up job failed"

# A submit directory laid out like the repository, so train.sbatch runs with its defaults.
sub=$tmp/submit
mkdir -p "$sub/target/release"
ln -s "$launch" "$sub/target/release/launch"
ln -s "$repo/configs" "$sub/configs"
tiny=(configs/default.toml --num-processes 2 --set 'data.synthetic="tiny"' --set 'model.kind="bpr"'
  --set 'train.loss="bpr"' --set 'model.user_tower="id"' --set train.epochs=1 --set eval.patience=0)
step_re='epoch [0-9]+/[0-9]+ step [0-9]+'

# wait_for FILE REGEX SECONDS: the time (us) FILE first has a line matching REGEX (polled
# every 10 ms); fails after SECONDS
wait_for() {
  local f=$1 re=$2 end=$(($(now_us) + $3 * 1000000))
  while :; do
    if [ -f "$f" ] && grep -qE -- "$re" "$f"; then now_us; return 0; fi
    [ "$(now_us)" -lt "$end" ] || return 1
    sleep 0.01
  done
}

free_port() {
  local p
  while :; do
    p=$((20000 + RANDOM % 10000))
    [ -z "$(ss -Hltn "( sport = :$p )" 2>/dev/null)" ] && { echo $p; return; }
  done
}

: >"$tmp/slurm_first"; : >"$tmp/slurm_sched"; : >"$tmp/slurm_script"; : >"$tmp/hand_first"; : >"$tmp/slurm_total"; : >"$tmp/hand_total"
echo "slurm_start: $runs alternating runs, 2 nodes x 2 processes, tiny config (bpr, synthetic tiny, 1 epoch), $(nproc) cores"
for i in $(seq "$runs"); do
  # --- slurm: sbatch -> first step line ---
  t0=$(now_us)
  job=$(cd "$sub" && slurm sbatch --parsable -N2 "$repo/scripts/slurm/train.sbatch" "${tiny[@]}" \
    --set "run.output_dir=\"$tmp/runs-slurm-$i\"")
  job=${job%%;*}
  ts=$(wait_for "$sub/slurm-gptrec-$job.out" '^train.sbatch: job' 120) ||
    { slurm scontrol show job "$job" >&2 || true; fail "job $job: the batch script did not start within 120 s"; }
  t1=$(wait_for "$sub/logs/slurm-$job/rank-0.log" "$step_re" 120) ||
    { cat "$sub/slurm-gptrec-$job.out" >&2 || true; fail "job $job: no step line within 120 s"; }
  while [ -n "$(slurm squeue -h -j "$job" -t PD,CF,R,CG -o %i 2>/dev/null)" ]; do sleep 0.01; done
  t2=$(now_us)
  grep -q '\] summary:' "$sub/slurm-gptrec-$job.out" ||
    { cat "$sub/slurm-gptrec-$job.out" >&2; fail "job $job did not finish its run"; }
  echo $((t1 - t0)) >>"$tmp/slurm_first"; echo $((t2 - t0)) >>"$tmp/slurm_total"
  echo $((ts - t0)) >>"$tmp/slurm_sched"; echo $((t1 - ts)) >>"$tmp/slurm_script"

  # --- by hand: two launch processes on this machine, one shared secret ---
  port=$(free_port)
  logs=$tmp/logs-hand-$i
  rid="hand-$i-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
  t0=$(now_us)
  for r in 0 1; do
    "$launch" --nnodes 2 --node-rank $r --master-addr 127.0.0.1 \
      --master-port "$port" --run-id "$rid" --rank-logs "$logs" "${tiny[@]}" --set "run.output_dir=\"$tmp/runs-hand-$i\"" \
      --set "run.name=\"hand-$i\"" >"$tmp/hand-$i-$r.out" 2>&1 &
  done
  t1=$(wait_for "$logs/rank-0.log" "$step_re" 120) || { cat "$tmp/hand-$i-0.out" >&2; fail "by hand: no step line within 120 s"; }
  rc=0; wait || rc=$?
  t2=$(now_us)
  if [ $rc != 0 ] || ! grep -q '\] summary:' "$tmp/hand-$i-0.out"; then
    cat "$tmp/hand-$i-0.out" "$tmp/hand-$i-1.out" >&2; fail "by hand: the run failed"
  fi
  echo $((t1 - t0)) >>"$tmp/hand_first"; echo $((t2 - t0)) >>"$tmp/hand_total"
done

# --- launch's share, measured inside one 2-node job ---
{
  echo '#!/bin/bash'
  echo 'set -u'
  printf 'TINY=(%s)\n' "$(printf '%q ' "${tiny[@]}")"
  cat <<'EOF'
now_us() { echo "${EPOCHREALTIME/./}"; }
one() { srun -N2 -n2 --ntasks-per-node=1 "$@" >/dev/null 2>&1 || { echo "failed: srun $*" >&2; exit 1; }; }
for i in $(seq "$RUNS"); do
  t0=$(now_us); one /bin/true; t1=$(now_us)
  one "$LAUNCH" --num-processes 2 -- /bin/true; t2=$(now_us)
  one "$LAUNCH" --dry-run "${TINY[@]}"; t3=$(now_us)
  echo "$((t1 - t0)) $((t2 - t1)) $((t3 - t2))"
done
EOF
} >"$tmp/share.sh"
(cd "$sub" && RUNS=$runs LAUNCH=$launch slurm sbatch --wait -N2 -o "$tmp/share.out" "$tmp/share.sh" >/dev/null) ||
  { cat "$tmp/share.out" >&2; fail "the srun job failed"; }
awk '{print $1}' "$tmp/share.out" >"$tmp/srun_true"
awk '{print $2}' "$tmp/share.out" >"$tmp/srun_launch"
awk '{print $3}' "$tmp/share.out" >"$tmp/srun_dry"
awk '{print $2 - $1}' "$tmp/share.out" >"$tmp/launch_share"
awk '{print $3 - $1}' "$tmp/share.out" >"$tmp/dry_share"
paste "$tmp/slurm_first" "$tmp/hand_first" | awk '{print $1 - $2}' >"$tmp/slurm_extra"

row() { # row LABEL FILE
  local m mm
  m=$(median <"$2"); mm=$(minmax <"$2")
  awk -v l="$1" -v m="$m" -v mm="$mm" 'BEGIN {split(mm, a, " "); printf "  %-58s %9.1f %9.1f %9.1f\n", l, m/1000, a[1]/1000, a[2]/1000}'
}
printf "  %-58s %9s %9s %9s\n" "(ms, $runs runs)" median min max
row "slurm:   sbatch -> first step line (train.sbatch)" "$tmp/slurm_first"
row "by hand: 2 x launch -> first step line" "$tmp/hand_first"
row "  difference: Slurm's part (submit, schedule, srun)" "$tmp/slurm_extra"
row "  slurm: sbatch -> batch script's first line" "$tmp/slurm_sched"
row "  slurm: batch script's first line -> first step line" "$tmp/slurm_script"
row "slurm:   sbatch -> job gone from squeue" "$tmp/slurm_total"
row "by hand: 2 x launch -> both exited" "$tmp/hand_total"
row "srun -N2 /bin/true (in the job)" "$tmp/srun_true"
row "srun -N2 launch --num-processes 2 -- /bin/true" "$tmp/srun_launch"
row "  launch's share: start 2 workers, reap them, exit" "$tmp/launch_share"
row "srun -N2 launch --dry-run CONFIG (tiny)" "$tmp/srun_dry"
row "  launch's share: parse, validate, plan, estimate" "$tmp/dry_share"
