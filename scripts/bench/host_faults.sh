#!/usr/bin/env bash
# Faults across separate hosts: three network namespaces h0, h1, h2 (each its own address on a
# private bridge, host name and /dev/shm, as tests/tests/hosts.rs makes them), one `launch` per
# host, an elastic job `--nnodes 2:3` of 2 workers per host (tiny bpr, global 24, micro 2,
# dist.timeout_s 8, a checkpoint every 50 steps; rendezvous at h0 by name, default
# --local-addr). After the checkpoint of step 100, host h2 is lost, two ways:
#   host killed  every process of h2 (launch, its watchdog, the workers) SIGKILLed at once
#   link cut     h2's link taken down at the bridge (`ip link set ... down`): silence, no errors
# and we time, from the fault:
#   detection    the first line on a surviving host saying h2 is gone (ours: `launch: ... node
#                id 2 is gone`; torchrun: its agent's `Worker group FAILED`)
#   first step   the first optimizer step of the group re-formed without h2 (ours: the
#                workers' sample traces, GPTREC_TRACE_SAMPLES; torchrun: the peer's FIRST_STEP
#                line with restart >= 1 and world 4)
# The peer: torchrun (PyTorch 2.11.0, c10d rendezvous, same namespaces, shape, range,
# last_call_timeout and max restarts) running scripts/bench/host_faults_peer.py (gloo, an
# all-reduce every 5 ms with our dist.timeout_s as its timeout, nothing to load), once with its
# defaults and once with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the workaround of
# pytorch/pytorch#135712: by default the re-formed workers share the first round's TCP store and
# can read the dead group's addresses from it); a re-formed group that does not step within
# PEER_WAIT seconds (default 90) is reported as such.
# Each case runs REPEAT times (default 3); the table has medians, the lines below it every run.
#
# Needs root (ip netns, unshare). Contacts no address outside the namespaces it makes, and
# removes them (and every process in them) when it ends, however it ends.
#
# Usage: [REPEAT=3] [PEER_WAIT=90] scripts/bench/host_faults.sh
set -eu
cd "$(dirname "$0")/../.."
if [ "$(id -u)" != 0 ]; then
  echo "host_faults: needs root (network namespaces); nothing was run" >&2
  exit 1
fi
PATH="$PATH:/usr/sbin:/sbin"
for program in ip unshare; do
  command -v "$program" >/dev/null || { echo "host_faults: no $program; nothing was run" >&2; exit 1; }
done
. scripts/bench/lib.sh
export OMP_NUM_THREADS=1
repeat=${REPEAT:-3}
peer_wait=${PEER_WAIT:-90}
dist_timeout=8

tag="gptrec-bench-$$"
subnet=$(($$ % 250 + 1))
files="$out/hostfiles"
mkdir -p "$files"
{
  echo "127.0.0.1 localhost"
  for i in 0 1 2; do echo "10.231.$subnet.$((i + 1)) h$i"; done
} >"$files/hosts"
echo "hosts: files" >"$files/nsswitch.conf"

# Every process in namespace $1, stopped, then SIGKILLed (none reacts to the others' end).
kill_ns() {
  local pids
  pids=$(ip netns pids "$1" 2>/dev/null || true)
  [ -n "$pids" ] || return 0
  kill -STOP $pids 2>/dev/null || true
  pids="$pids $(ip netns pids "$1" 2>/dev/null || true)"
  kill -KILL $pids 2>/dev/null || true
}
cleanup() {
  for i in 0 1 2; do
    for _ in 1 2 3 4 5; do
      kill_ns "$tag-h$i"
      [ -z "$(ip netns pids "$tag-h$i" 2>/dev/null)" ] && break
      sleep 0.2
    done
    ip netns del "$tag-h$i" 2>/dev/null || true
  done
  ip netns del "$tag-br" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$tag-br"
ip -n "$tag-br" link set lo up
ip -n "$tag-br" link add br0 type bridge
ip -n "$tag-br" link set br0 up
for i in 0 1 2; do
  ip netns add "$tag-h$i"
  ip -n "$tag-h$i" link set lo up
  ip -n "$tag-br" link add "h$i" type veth peer name eth0 netns "$tag-h$i"
  ip -n "$tag-br" link set "h$i" master br0
  ip -n "$tag-br" link set "h$i" up
  ip -n "$tag-h$i" addr add "10.231.$subnet.$((i + 1))/24" dev eth0
  ip -n "$tag-h$i" link set eth0 up
done

# on I CMD...: runs CMD as host I (its network, host name, /dev/shm and hosts file).
on() {
  local i=$1
  shift
  ip netns exec "$tag-h$i" unshare --mount --uts sh -c '
    set -e; name=$1; files=$2; shift 2
    hostname "$name"
    mount -t tmpfs -o mode=1777 tmpfs /dev/shm
    mount --bind "$files/hosts" /etc/hosts
    mount --bind "$files/nsswitch.conf" /etc/nsswitch.conf
    exec "$@"' host-init "h$i" "$files" "$@"
}
# Prefixes every line with the unix time it arrived at.
stamp() {
  python3 -u -c '
import sys, time
for line in sys.stdin:
    sys.stdout.write(f"{time.time():.3f} {line}")
    sys.stdout.flush()'
}
now() { date +%s.%N; }
cut_link() { ip -n "$tag-br" link set "h$1" down; }
restore_link() { ip -n "$tag-br" link set "h$1" up; }
# until_true SECS CMD...: runs CMD every 50 ms until it succeeds (0) or SECS pass (1).
until_true() {
  local end=$(($(date +%s) + $1))
  shift
  until "$@"; do
    [ "$(date +%s)" -lt "$end" ] || return 1
    sleep 0.05
  done
}
# The time stamp of the first line matching $1 at or after time $2 in files $3... (empty if none).
first_stamp() {
  local pattern=$1 since=$2
  shift 2
  grep -h -E "$pattern" "$@" 2>/dev/null | awk -v t="$since" '$1 >= t { print $1 }' | sort -n | head -n 1
}
secs() { python3 -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.2f}')" "$1" "$2"; }
stop_hosts() {
  for i in 0 1 2; do kill_ns "$tag-h$i"; done
  wait 2>/dev/null || true
  for i in 0 1 2; do restore_link "$i"; done
}

# ours FAULT RUN PORT -> "<detection s> <first step s>" ("-" where none)
ours() {
  local fault=$1 run=$2 port=$3 dir="$out/ours-$1-$2"
  mkdir -p "$dir/trace"
  local i
  for i in 0 1 2; do
    GPTREC_TRACE_SAMPLES="$dir/trace" on "$i" "$launch" --nnodes 2:3 --num-processes 2 \
      --rdzv-backend c10d --rdzv-endpoint "h0:$port" --run-id-file "$dir/job.id" \
      --rdzv-conf last_call_timeout=5 --rdzv-timeout 30 --max-restarts 3 --grace-period 2 \
      configs/default.toml --set run.output_dir=\""$dir"\" --set data.synthetic=\"tiny\" \
      --set model.kind=\"bpr\" "${bpr_id[@]}" --set train.epochs=20 --set eval.patience=0 \
      --set dist.timeout_s=$dist_timeout --set batch.global=24 --set batch.micro=2 \
      --set checkpoint.every_n_steps=50 2>&1 | stamp >"$dir/h$i.log" &
    if [ "$i" = 0 ]; then
      until_true 60 grep -q "hosts the rendezvous store" "$dir/h0.log" || true
    fi
    sleep 0.3
  done
  if ! until_true 120 grep -q "checkpoints/step-000100" "$dir/h0.log"; then
    echo "ours $fault $run: the job did not reach step 100: see $dir" >&2
    stop_hosts
    echo "- -"
    return
  fi
  local t0
  t0=$(now)
  if [ "$fault" = kill ]; then kill_ns "$tag-h2"; else cut_link 2; fi
  until_true 60 grep -q "is gone" "$dir/h0.log" "$dir/h1.log" || true
  until_true 60 sh -c "cat '$dir'/trace/trace-1-*.txt 2>/dev/null | grep -q ." || true
  sleep 0.5
  local detected first
  detected=$(first_stamp " is gone" "$t0" "$dir/h0.log" "$dir/h1.log")
  first=$(cat "$dir"/trace/trace-1-*.txt 2>/dev/null | cut -d' ' -f3 | sort -n | head -n 1)
  stop_hosts
  echo "$([ -n "$detected" ] && secs "$detected" "$t0" || echo -) $([ -n "$first" ] && secs "$(python3 -c "print($first / 1000)")" "$t0" || echo -)"
}

# theirs FAULT RUN PORT [VARIANT] -> "<detection s> <first step s>" ("-" where none); VARIANT
# `unshared` sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch/pytorch#135712's workaround).
theirs() {
  local fault=$1 run=$2 port=$3 variant=${4:-defaults} dir="$out/torchrun-${4:-defaults}-$1-$2"
  local unshare_store=0
  [ "$variant" = unshared ] && unshare_store=1
  mkdir -p "$dir"
  local i
  for i in 0 1 2; do
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$unshare_store PEER_TIMEOUT_S=$dist_timeout LOGLEVEL=INFO \
      on "$i" torchrun --nnodes 2:3 --nproc-per-node 2 \
      --rdzv-backend c10d --rdzv-endpoint "h0:$port" --rdzv-id "peer-$$-$port" \
      --rdzv-conf last_call_timeout=5 --max-restarts 3 scripts/bench/host_faults_peer.py \
      2>&1 | stamp >"$dir/h$i.log" &
    sleep 0.3
  done
  # All 6 ranks stepped in one round (it may take torchrun a restart or two to get there).
  six() { grep -h -o "FIRST_STEP [0-9.]* restart=[0-9]* world=6" "$dir"/h*.log | cut -d' ' -f3 | sort | uniq -c | awk '$1 >= 6 { ok = 1 } END { exit !ok }'; }
  if ! until_true 180 six; then
    echo "torchrun $fault $run: the group did not start: see $dir" >&2
    stop_hosts
    echo "- -"
    return
  fi
  sleep 2
  local t0
  t0=$(now)
  if [ "$fault" = kill ]; then kill_ns "$tag-h2"; else cut_link 2; fi
  stepped() { [ -n "$(first_stamp "FIRST_STEP [0-9.]+ restart=[0-9]+ world=4" "$t0" "$dir/h0.log" "$dir/h1.log")" ]; }
  until_true "$peer_wait" stepped || true
  local detected first
  detected=$(first_stamp "Worker group FAILED" "$t0" "$dir/h0.log" "$dir/h1.log")
  first=$(grep -h -o -E "FIRST_STEP [0-9.]+ restart=[0-9]+ world=4" "$dir/h0.log" "$dir/h1.log" |
    awk -v t="$t0" '$2 >= t { print $2 }' | sort -n | head -n 1)
  stop_hosts
  echo "$([ -n "$detected" ] && secs "$detected" "$t0" || echo -) $([ -n "$first" ] && secs "$first" "$t0" || echo -)"
}

median() { python3 -c '
import statistics, sys
v = [float(x) for x in sys.argv[1:] if x != "-"]
missing = len(sys.argv) - 1 - len(v)
if not v:
    print("none")
else:
    print(f"{statistics.median(v):.2f} s" + (f" ({missing} of {len(sys.argv) - 1} runs: none)" if missing else ""))' "$@"; }

torchrun_unshared() { theirs "$@" unshared; }
have_torchrun=1
command -v torchrun >/dev/null || have_torchrun=0
launchers="ours"
[ "$have_torchrun" = 1 ] && launchers="ours theirs torchrun_unshared"
declare -A det stp
port=29400
for fault in kill cut; do
  for who in $launchers; do
    det[$fault-$who]=""
    stp[$fault-$who]=""
    for run in $(seq 1 "$repeat"); do
      port=$((port + 1))
      read -r d s <<<"$($who "$fault" "$run" "$port")"
      echo "run $run, $fault, $who: fault -> detection $d s, fault -> first step $s s" >&2
      det[$fault-$who]="${det[$fault-$who]} $d"
      stp[$fault-$who]="${stp[$fault-$who]} $s"
    done
  done
done

label() { [ "$1" = kill ] && echo "host lost: all of h2's processes killed at once" || echo "link cut: h2's link down at the bridge"; }
name() {
  case $1 in
    ours) echo "ours (\`launch\`)" ;;
    theirs) echo "torchrun, defaults" ;;
    *) echo "torchrun, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" ;;
  esac
}
step_cell() { # VALUES...
  local m
  m=$(median "$@")
  [ "$m" = none ] && echo "none within $peer_wait s" || echo "$m"
}
echo
echo "| fault (3 hosts x 2 workers; median of $repeat runs) | launcher | fault -> detection | fault -> first step of the re-formed group |"
echo "|---|---|---|---|"
for fault in kill cut; do
  for who in $launchers; do
    echo "| $(label $fault) | $(name $who) | $(median ${det[$fault-$who]}) | $(step_cell ${stp[$fault-$who]}) |"
  done
done
[ "$have_torchrun" = 1 ] || echo "(torchrun not run: none in PATH)"
echo
for fault in kill cut; do
  for who in $launchers; do
    echo "$fault, $(name $who), every run (s): detection${det[$fault-$who]}; first step${stp[$fault-$who]}"
  done
done
echo "torchrun's documented defaults: c10d rendezvous keep-alive every 5 s, a node dropped after 3 missed (15 s); join_timeout 600 s, last_call_timeout 30 s (here 5); gloo's collective timeout 30 min (here $dist_timeout s, as ours)"
echo "ours: heartbeat every 0.5 s, a node dropped after 3 s without one, at once when its launcher's store connection closes; collectives time out after dist.timeout_s"
