#!/usr/bin/env bash
# minicluster.sh - a throwaway Slurm cluster on this one machine, for the end-to-end tests
# (tests/tests/slurm.rs, through tests/tests/support/slurm.rs) and scripts/bench/slurm_start.sh.
# The project's copy of shared/slurm/minicluster.sh, adapted for tests: caller-chosen ports
# so that several clusters run side by side, restartable in the same DIR, and a `reap` for
# clusters whose test process died without stopping them.
# Needs root and: apt-get install -y --no-install-recommends slurm-wlm munge (Slurm 22.05).
#
#   minicluster.sh start DIR [NNODES]   munged + slurmctld + NNODES slurmd (default 1); a cluster
#                                       still running in DIR is stopped first
#   minicluster.sh stop  DIR            cancel jobs, stop the daemons by pid, kill whatever is
#                                       left of the jobs; leaves nothing running (DIR may be gone)
#   minicluster.sh status DIR
#   minicluster.sh reap BASE            stop every cluster BASE/*/ whose owner (MC_OWNER) is dead
#
# Env for start:
#   MC_PORT   slurmctld port (default 16817); slurmd i listens on MC_PORT+1+i; all must be free
#             (exit code 3 when one is taken: pick another MC_PORT)
#   MC_CPUS   CPUs per emulated node (default: nproc; may exceed the real cores)
#   MC_GPUS   fake GPUs per node (default 0): gres/gpu on dummy char devices (mknod c 1 3), so
#             --gpus-per-node sets CUDA_VISIBLE_DEVICES / SLURM_GPUS_ON_NODE / SLURM_STEP_GPUS
#   MC_FIRST_JOB_ID  first job id (default 1). Clusters that run at the same time should use
#             distinct ranges: `launch` derives its rendezvous port from the job id, and all
#             clusters share this machine's ports
#   MC_CRED_EXPIRE   credential lifetime in s (default: Slurm's 120); also the delay before a
#             requeued job may start again
#   MC_OWNER  pid of the process that owns the cluster (for `reap`; default: none)
#   MC_HOSTS  1 (default): each slurmd runs in a private mount namespace whose /etc/hosts maps
#             n0..nN-1 to 127.0.0.1, so job steps resolve node names; 0: don't
# Nodes are n0..n(N-1), all NodeAddr=127.0.0.1, partition "debug". Clients need
# SLURM_CONF=DIR/etc/slurm.conf (or: . DIR/env.sh).
set -euo pipefail

die() { echo "minicluster: $*" >&2; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}'; }

# alive PID: exists and is not a zombie
alive() {
  local st
  [ -r "/proc/$1/stat" ] || return 1
  st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ -n "$st" ] && [ "$st" != "Z" ] && [ "$st" != "X" ]
}

# pid_is_ours PID DIR: the pid's command line mentions DIR (guards against pid reuse)
pid_is_ours() {
  [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "$2"
}

port_busy() {
  if command -v ss >/dev/null; then
    [ -n "$(ss -Hltn "( sport = :$1 )" 2>/dev/null)" ]
  else
    awk -v p="$(printf '%04X' "$1")" 'NR>1 && $4=="0A" && substr($2, index($2,":")+1)==p {f=1} END{exit !f}' /proc/net/tcp /proc/net/tcp6
  fi
}

any_alive() {
  local d=$1 name pid
  [ -f "$d/pids" ] || return 1
  while read -r name pid; do
    if alive "$pid" && pid_is_ours "$pid" "$d"; then return 0; fi
  done <"$d/pids"
  return 1
}

cmd_start() {
  local D=$1 N=${2:-1}
  local PORT=${MC_PORT:-16817} CPUS=${MC_CPUS:-$(nproc)} GPUS=${MC_GPUS:-0} HOSTS=${MC_HOSTS:-1}
  local FIRST=${MC_FIRST_JOB_ID:-1} CRED=${MC_CRED_EXPIRE:-} OWNER=${MC_OWNER:-}
  local t0 i p name c
  t0=$(now)
  [ "$(id -u)" = 0 ] || die "must run as root"
  for c in munged mungekey munge unmunge slurmctld slurmd sinfo scontrol squeue scancel; do
    command -v $c >/dev/null || die "missing $c (apt-get install -y --no-install-recommends slurm-wlm munge)"
  done
  [[ "$N" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer"
  if ! [[ "$PORT" =~ ^[0-9]+$ ]] || [ $((PORT + N)) -gt 65535 ]; then die "bad MC_PORT $PORT"; fi
  [[ "$FIRST" =~ ^[1-9][0-9]*$ ]] || die "bad MC_FIRST_JOB_ID $FIRST"
  mkdir -p "$D"; D=$(cd "$D" && pwd -P)
  if [ -e "$D/.minicluster" ]; then
    if any_alive "$D" || [ -f "$D/pids" ]; then
      echo "minicluster: a cluster was left in $D; stopping it first" >&2
      cmd_stop "$D" >&2
    fi
    rm -rf "${D:?}"/{etc,munge-key,munge,spool,state,log,dev,pids,pids.stopped,env.sh,owner}
  elif [ -n "$(ls -A "$D")" ]; then
    die "$D is not empty and not a minicluster dir"
  fi
  for ((i = 0; i <= N; i++)); do
    if port_busy $((PORT + i)); then echo "minicluster: port $((PORT + i)) busy; set MC_PORT" >&2; exit 3; fi
  done
  touch "$D/.minicluster"
  chmod 755 "$D"
  mkdir -p "$D"/{etc,munge-key,munge,spool,state,log}
  chmod 700 "$D/munge-key"; chmod 755 "$D/munge"
  : >"$D/pids"
  [ -n "$OWNER" ] && echo "$OWNER $(owner_start "$OWNER")" >"$D/owner"
  trap 'echo "minicluster: start failed, stopping what was started" >&2; cmd_stop "$D" >&2 || true' EXIT

  # --- munge (its own key and socket under DIR; the system's munged is not used) ---
  mungekey -c -k "$D/munge-key/munge.key" 2>/dev/null ||
    { dd if=/dev/urandom of="$D/munge-key/munge.key" bs=1024 count=1 status=none; chmod 600 "$D/munge-key/munge.key"; }
  local SOCK=$D/munge/munge.sock
  # --force: tolerate a DIR whose parents are not world-executable (e.g. under /root)
  munged -F --force --num-threads=10 --key-file="$D/munge-key/munge.key" --socket="$SOCK" \
    --pid-file="$D/munge/munged.pid" --log-file="$D/log/munged.log" --seed-file="$D/munge/munged.seed" \
    </dev/null >"$D/log/munged.out" 2>&1 &
  echo "munged $!" >>"$D/pids"
  for i in $(seq 100); do munge -n -S "$SOCK" >/dev/null 2>&1 && break; sleep 0.05; done
  munge -n -S "$SOCK" | unmunge -S "$SOCK" >/dev/null 2>&1 || die "munged did not come up; see $D/log/munged.out"

  # --- config ---
  local CONF=$D/etc/slurm.conf HOST AUTH="socket=$SOCK"
  HOST=$(hostname -s)
  [ -n "$CRED" ] && AUTH+=",cred_expire=$CRED"
  cat >"$CONF" <<EOF
ClusterName=minicluster
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=$AUTH
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=2
MinJobAge=4
FirstJobId=$FIRST
SchedulerParameters=batch_sched_delay=0,sched_interval=1
SlurmctldPidFile=$D/state/slurmctld.pid
SlurmdPidFile=$D/spool/%n/slurmd.pid
SlurmdSpoolDir=$D/spool/%n
StateSaveLocation=$D/state
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldDebug=info
SlurmdDebug=info
EOF
  local GRES="" g
  if [ "$GPUS" -gt 0 ]; then
    echo "GresTypes=gpu" >>"$CONF"
    echo "AutoDetect=off" >"$D/etc/gres.conf"
    mkdir -p "$D/dev"
    GRES=" Gres=gpu:$GPUS"
  fi
  local hosts_line="127.0.0.1"
  for ((i = 0; i < N; i++)); do
    echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 1 + i)) CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=1000$GRES State=UNKNOWN" >>"$CONF"
    mkdir -p "$D/spool/n$i"
    hosts_line+=" n$i"
    if [ "$GPUS" -gt 0 ]; then
      for ((g = 0; g < GPUS; g++)); do mknod "$D/dev/n${i}gpu$g" c 1 3; done
      echo "NodeName=n$i Name=gpu File=$D/dev/n${i}gpu[0-$((GPUS - 1))]" >>"$D/etc/gres.conf"
    fi
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
  { cat /etc/hosts; echo "$hosts_line"; } >"$D/etc/hosts"
  printf 'export SLURM_CONF=%q\n' "$CONF" >"$D/env.sh"
  export SLURM_CONF=$CONF

  # --- slurmctld ---
  slurmctld -D -f "$CONF" </dev/null >"$D/log/slurmctld.out" 2>&1 &
  local ctld=$!
  echo "slurmctld $ctld" >>"$D/pids"
  for i in $(seq 200); do
    scontrol ping 2>/dev/null | grep -q UP && break
    alive $ctld || break
    sleep 0.05
  done
  scontrol ping 2>/dev/null | grep -q UP || die "slurmctld did not come up; see $D/log/slurmctld.out"

  # --- one slurmd per emulated node (Debian's build has MULTIPLE_SLURMD=Yes) ---
  local use_ns=0
  if [ "$HOSTS" = 1 ] && unshare -m true 2>/dev/null; then use_ns=1; fi
  for ((i = 0; i < N; i++)); do
    if [ $use_ns = 1 ]; then
      # unshare and sh both exec, so $! is slurmd's pid
      # shellcheck disable=SC2016 # expanded by the inner sh
      unshare -m -- sh -c 'mount --bind "$1" /etc/hosts && exec slurmd -D -N "$2" -f "$3"' \
        sh "$D/etc/hosts" "n$i" "$CONF" </dev/null >"$D/log/slurmd-n$i.out" 2>&1 &
    else
      slurmd -D -N "n$i" -f "$CONF" </dev/null >"$D/log/slurmd-n$i.out" 2>&1 &
    fi
    echo "slurmd-n$i $!" >>"$D/pids"
  done

  # --- wait until every node is idle ---
  local ok=0
  for i in $(seq 600); do
    if [ "$(sinfo -h -N -o '%t' 2>/dev/null | grep -c '^idle$')" = "$N" ]; then ok=1; break; fi
    while read -r name p; do alive "$p" || die "$name ($p) died; see $D/log"; done <"$D/pids"
    sleep 0.05
  done
  [ $ok = 1 ] || { sinfo -N >&2 || true; die "nodes not idle after 30s; logs in $D/log"; }
  trap - EXIT
  echo "minicluster: $N node(s) up in $(elapsed "$t0")s; export SLURM_CONF=$CONF"
}

# owner_start PID: the process's start time (field 22 of stat), to tell a reused pid apart
owner_start() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f20 || true; }

# pids of processes holding a unix socket under DIR/spool (leftover slurmstepd)
stepd_pids() {
  local D=$1 inodes p fd l
  inodes=$(awk -v d="$D/spool/" 'index($8, d) == 1 {print $7}' /proc/net/unix | sort -u)
  [ -n "$inodes" ] || return 0
  for p in /proc/[0-9]*; do
    for fd in "$p"/fd/*; do
      l=$(readlink "$fd" 2>/dev/null) || continue
      case $l in socket:\[*\])
        l=${l#socket:[}; l=${l%]}
        if grep -qx "$l" <<<"$inodes"; then echo "${p#/proc/}"; break; fi ;;
      esac
    done
  done
}

# descendants PID...: all live descendants (by ppid)
descendants() {
  ps -e -o pid=,ppid= | awk -v roots="$*" '
    BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
    { par[$1] = $2 }
    END { do { ch = 0; for (p in par) if (!(p in keep) && (par[p] in keep)) { keep[p] = 1; out[p] = 1; ch = 1 } } while (ch)
          for (p in out) print p }'
}

# ancestors: this shell and every process above it (never killed by the sweep)
ancestors() {
  local p=$$
  while [ -n "$p" ] && [ "$p" != 0 ]; do
    echo "$p"
    p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null || true)
  done
}

# env_pids CONF: processes whose environment has SLURM_CONF=CONF: every job task (sbatch and
# srun pass the submitter's environment on), slurmstepd, and the daemons we started
env_pids() {
  local needle="SLURM_CONF=$1" skip p
  skip=" $(ancestors | tr '\n' ' ') "
  grep -lzxF -- "$needle" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | while read -r p; do
    case $skip in *" $p "*) continue ;; esac
    if alive "$p"; then echo "$p"; fi
  done
  return 0
}

stop_pid() { # stop_pid PID NAME : TERM, wait up to 10s, then KILL
  local pid=$1 name=$2 i
  alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 200); do alive "$pid" || return 0; sleep 0.05; done
  echo "minicluster: $name ($pid) ignored SIGTERM, sending SIGKILL" >&2
  kill -KILL "$pid" 2>/dev/null || true
  for i in $(seq 100); do alive "$pid" || return 0; sleep 0.05; done
}

kill_all() { # kill_all PID... : SIGKILL, then wait until they are gone (5 s at most)
  local pid i
  [ $# -gt 0 ] || return 0
  kill -KILL "$@" 2>/dev/null || true
  for pid in "$@"; do for i in $(seq 100); do alive "$pid" || break; sleep 0.05; done; done
}

cmd_stop() {
  local D=$1 t0 name pid i n
  t0=$(now)
  [ -d "$D" ] || { echo "minicluster: $D does not exist; nothing to stop"; return 0; }
  [ -f "$D/.minicluster" ] || die "$D is not a minicluster dir"
  D=$(cd "$D" && pwd -P)
  [ -f "$D/pids" ] || { echo "minicluster: nothing to stop in $D"; return 0; }
  local CONF=$D/etc/slurm.conf
  # 1. cancel jobs so their slurmstepd exit (killing slurmd alone leaves them running)
  local ctld
  ctld=$(awk '$1=="slurmctld"{print $2}' "$D/pids")
  if [ -n "$ctld" ] && alive "$ctld" && pid_is_ours "$ctld" "$D"; then
    local jobs
    jobs=$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      SLURM_CONF=$CONF scancel $jobs 2>/dev/null || true
      for i in $(seq 100); do [ -z "$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.05; done
    fi
  fi
  # 2. slurmd(s), then slurmctld, then munged -- only pids we recorded, checked against DIR
  for name in slurmd slurmctld munged; do
    while read -r n pid; do
      case $n in "$name"*) ;; *) continue ;; esac
      if alive "$pid" && pid_is_ours "$pid" "$D"; then stop_pid "$pid" "$n"; fi
    done <"$D/pids"
  done
  # 3. leftover slurmstepd (a slurmd died under a running job, or a job ignored the cancel):
  #    by their spool socket, with their process trees
  local left tree
  left=$(stepd_pids "$D" | tr "\n" " ")
  if [ -n "$left" ]; then
    # shellcheck disable=SC2086
    tree=$(descendants $left | tr "\n" " ")
    echo "minicluster: killing leftover slurmstepd $left and tasks $tree" >&2
    # shellcheck disable=SC2086
    kill_all $tree $left
  fi
  # 4. anything else the jobs started (a task that left its slurmstepd's tree): by the
  #    SLURM_CONF in its environment
  left=$(env_pids "$CONF" | tr "\n" " ")
  if [ -n "$left" ]; then
    echo "minicluster: killing leftover job processes $left" >&2
    # shellcheck disable=SC2086
    kill_all $left
  fi
  mv "$D/pids" "$D/pids.stopped"
  echo "minicluster: stopped in $(elapsed "$t0")s"
}

cmd_status() {
  local D=$1 name pid
  [ -f "$D/pids" ] || { echo "not running"; return 1; }
  while read -r name pid; do
    if alive "$pid"; then echo "$name $pid running"; else echo "$name $pid dead"; fi
  done <"$D/pids"
  SLURM_CONF=$D/etc/slurm.conf sinfo -N 2>/dev/null || true
}

# reap BASE: stop and remove the clusters under BASE whose owner process is gone (a test run
# that was killed before it could stop its clusters)
cmd_reap() {
  local B=$1 d opid ostart
  [ -d "$B" ] || return 0
  for d in "$B"/*/; do
    d=${d%/}
    if [ ! -f "$d/.minicluster" ] || [ ! -f "$d/owner" ]; then continue; fi
    read -r opid ostart <"$d/owner" || continue
    if [ -n "$opid" ] && alive "$opid" && [ "$(owner_start "$opid")" = "$ostart" ]; then continue; fi
    echo "minicluster: reaping $d (owner $opid is gone)" >&2
    if [ -f "$d/pids" ]; then cmd_stop "$d" >&2 || true; fi
    rm -rf "$d"
  done
}

case "${1:-}" in
  start) [ $# -ge 2 ] || die "usage: $0 start DIR [NNODES]"; cmd_start "$2" "${3:-1}" ;;
  stop) [ $# -ge 2 ] || die "usage: $0 stop DIR"; cmd_stop "$2" ;;
  status) [ $# -ge 2 ] || die "usage: $0 status DIR"; cmd_status "$2" ;;
  reap) [ $# -ge 2 ] || die "usage: $0 reap BASE"; cmd_reap "$2" ;;
  *) die "usage: $0 {start DIR [NNODES]|stop DIR|status DIR|reap BASE}" ;;
esac
