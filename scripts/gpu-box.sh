#!/usr/bin/env bash
# gpu-box.sh: train on the idle GPUs of this machine (one box, one node).
#
#   scripts/gpu-box.sh [-n N|auto] [--max-mem-mib M] [--max-util P] CONFIG [launch options...]
#   e.g. scripts/gpu-box.sh configs/train.toml --set data.dir=/data/ml-1m
#        scripts/gpu-box.sh -n 2 configs/default.toml --set train.epochs=10
#
# 1. Asks nvidia-smi for every GPU's memory use and utilisation. A GPU is idle when it uses at
#    most M MiB (default 1024) and at most P % (default 10; a GPU that reports no utilisation,
#    e.g. a MIG slice, is judged by memory alone). It takes the N least used idle GPUs
#    (utilisation, then memory); `-n auto` (the default) takes every idle one. With
#    CUDA_VISIBLE_DEVICES set, only the GPUs it lists are candidates, and launch gets their
#    positions in that list. Too few idle GPUs: every GPU is listed with its usage and why it was
#    skipped, and the script exits with 2 without starting anything.
# 2. Runs `launch --gpu-ids IDS --rank-logs LOGS CONFIG [launch options...]`: one worker per picked
#    GPU; every rank's lines also go to LOGS/rank-N.log, where LOGS is a fresh dated directory
#    ${LOG_ROOT:-<repo>/logs}/<config file stem>/<YYYYmmdd-HHMMSS>. The script then *is* launch
#    (exec): Ctrl-C and signals reach it directly, and its exit code is the script's.
# 3. Running the same command again (same CONFIG and --set run.*, from the same directory, since
#    run.output_dir is relative to it) resumes: the run name is unchanged, so the workers continue
#    from <output_dir>/<run.name>/checkpoints/latest (checkpoint.resume = "auto") and rank 0 prints
#    `resuming from .../checkpoints/step-NNNNNN (epoch E, step S, ...)`; a finished run only
#    re-runs its test evaluation, and raising train.epochs continues it (tests/tests/gpu_box.rs
#    checks both with a real run). Each invocation gets its own log directory. Start over with
#    another --set run.name=... or --set checkpoint.resume=\"never\". Resuming on a different
#    number of GPUs works as long as batch.global stays the same.
#    `-n auto` can pick a GPU count that the config's batch plan does not divide
#    (micro x grad_accum x world = global); launch then refuses with the nearest valid values,
#    and -n picks the count.
#
# Environment: LAUNCH (the launch binary; default <repo>/target/release/launch, else `launch` on
# PATH), LOG_ROOT (default <repo>/logs), CUDA_VISIBLE_DEVICES (restricts the candidates),
# GPUBOX_NVIDIA_SMI (another nvidia-smi; the tests point it at a fake).
# Exit code: launch's; 2 for a bad command line, no nvidia-smi, or too few idle GPUs.
set -euo pipefail

me=gpu-box
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    cat <<EOF
usage: scripts/gpu-box.sh [-n N|auto] [--max-mem-mib M] [--max-util P] CONFIG [launch options...]

Runs \`launch --gpu-ids IDS --rank-logs LOGS CONFIG [launch options...]\` on the idle GPUs of this box.

  -n, --num-gpus N|auto  GPUs to use: the N least used idle ones, or every idle one (default auto)
  --max-mem-mib M        idle means at most M MiB of GPU memory used (default 1024)
  --max-util P           ... and at most P % utilisation (default 10)
  -h, --help             this help

Options after CONFIG go to launch (--set key=value, --master-port, --max-restarts, ...).
Logs: \${LOG_ROOT:-$repo/logs}/<config stem>/<YYYYmmdd-HHMMSS>/rank-N.log.
Run the same command again to resume from the run's latest checkpoint.
Environment: LAUNCH (launch binary), LOG_ROOT, CUDA_VISIBLE_DEVICES, GPUBOX_NVIDIA_SMI.
EOF
}

die() {
    echo "$me: error: $*" >&2
    exit 2
}

need_value() {
    (($# >= 2)) || die "$1 needs a value (see --help)"
}

# --- command line -----------------------------------------------------------------------------
want=auto
max_mem=1024
max_util=10
while (($#)); do
    case $1 in
    -h | --help)
        usage
        exit 0
        ;;
    -n | --num-gpus)
        need_value "$@"
        want=$2
        shift 2
        ;;
    --num-gpus=*) want=${1#*=} && shift ;;
    -n?*) want=${1#-n} && shift ;;
    --max-mem-mib)
        need_value "$@"
        max_mem=$2
        shift 2
        ;;
    --max-mem-mib=*) max_mem=${1#*=} && shift ;;
    --max-util)
        need_value "$@"
        max_util=$2
        shift 2
        ;;
    --max-util=*) max_util=${1#*=} && shift ;;
    --)
        shift
        break
        ;;
    -*) die "unknown option $1 (gpu-box's options come before CONFIG, launch's after it; see --help)" ;;
    *) break ;;
    esac
done
(($#)) || die "missing CONFIG (usage: scripts/gpu-box.sh [-n N|auto] [--max-mem-mib M] [--max-util P] CONFIG [launch options...])"
config=$1
shift

[[ $want == auto || $want =~ ^[0-9]+$ && $((10#$want)) -ge 1 ]] ||
    die "-n $want: expected a number of GPUs >= 1 or auto"
[[ $want == auto ]] || want=$((10#$want))
[[ $max_mem =~ ^[0-9]+$ ]] || die "--max-mem-mib $max_mem: expected MiB (a whole number >= 0)"
[[ $max_util =~ ^[0-9]+$ && $((10#$max_util)) -le 100 ]] ||
    die "--max-util $max_util: expected a percentage 0-100"
max_mem=$((10#$max_mem))
max_util=$((10#$max_util))
[[ -f $config ]] || die "$config: no such config file"
for arg in "$@"; do
    case $arg in
    --) break ;;
    --gpu-ids | --gpu_ids | --gpu-ids=* | --gpu_ids=*)
        die "$arg: gpu-box picks the GPUs (use -n N, or CUDA_VISIBLE_DEVICES to limit the candidates; or run launch directly)"
        ;;
    --rank-logs | --rank-logs=*)
        die "$arg: gpu-box picks the rank logs directory (set LOG_ROOT instead)"
        ;;
    esac
done

if [[ -n ${LAUNCH:-} ]]; then
    launch=$LAUNCH
    [[ -f $launch && -x $launch ]] || launch=$(command -v "$launch") ||
        die "LAUNCH=$LAUNCH: no such executable"
elif [[ -x $repo/target/release/launch ]]; then
    launch=$repo/target/release/launch
elif ! launch=$(command -v launch); then
    die "no launch binary: build it (cd $repo && cargo build --release --workspace, or scripts/run.sh), or set LAUNCH=/path/to/launch"
fi

# --- the GPUs -----------------------------------------------------------------------------------
smi=${GPUBOX_NVIDIA_SMI:-nvidia-smi}
if ! command -v "$smi" >/dev/null 2>&1; then
    if [[ -n ${GPUBOX_NVIDIA_SMI:-} ]]; then
        die "GPUBOX_NVIDIA_SMI=$smi: no such executable, so no GPU can be picked"
    fi
    die "nvidia-smi not found: this script is for a machine with NVIDIA GPUs and their driver (on a CPU machine use launch --num-processes N CONFIG)"
fi
smi_err=$(mktemp)
trap 'rm -f "$smi_err"' EXIT
if ! csv=$("$smi" --query-gpu=index,memory.used,memory.total,utilization.gpu \
    --format=csv,noheader,nounits 2>"$smi_err"); then
    # its reason ("No devices were found", "... couldn't communicate with the NVIDIA driver")
    first=$({ printf '%s\n' "$csv"; cat "$smi_err"; } | grep -m1 '[^[:space:]]' || true)
    die "$smi --query-gpu failed: ${first:-no output} (no GPU can be picked)"
fi
rm -f "$smi_err"
trap - EXIT

# One row per GPU, in nvidia-smi's order: index, memory used, memory total, utilisation.
idx=() used=() total=() util=()
while IFS=, read -r i u t p rest; do
    [[ -n ${i//[[:space:]]/} ]] || continue
    i=${i//[[:space:]]/} u=${u//[[:space:]]/} t=${t//[[:space:]]/} p=${p//[[:space:]]/}
    [[ $i =~ ^[0-9]+$ && -z $rest ]] ||
        die "unexpected line from $smi: '$i, $u, $t, $p${rest:+, $rest}' (expected: index, memory.used, memory.total, utilization.gpu)"
    idx+=("$((10#$i))") used+=("$u") total+=("$t") util+=("$p")
done <<<"$csv"
((${#idx[@]})) || die "$smi lists no GPU"

uuids=()
load_uuids() { # only needed when CUDA_VISIBLE_DEVICES names GPUs by UUID
    if ((${#uuids[@]})); then return 0; fi
    local line i id
    for ((i = 0; i < ${#idx[@]}; i++)); do uuids+=(""); done
    while IFS=, read -r i id; do
        i=${i//[[:space:]]/} id=${id//[[:space:]]/}
        [[ $i =~ ^[0-9]+$ ]] || continue
        for ((line = 0; line < ${#idx[@]}; line++)); do
            if ((idx[line] == 10#$i)); then uuids[line]=$id; fi
        done
    done < <("$smi" --query-gpu=index,uuid --format=csv,noheader 2>/dev/null || true)
}

# Candidates: rows in the order CUDA sees them. CUDA_VISIBLE_DEVICES holds indices or (prefixes
# of) UUIDs and, as CUDA reads it, ends at the first entry that is invalid or repeated.
cand=()
cvd_note=""
if [[ -v CUDA_VISIBLE_DEVICES ]]; then
    IFS=, read -ra entries <<<"$CUDA_VISIBLE_DEVICES"
    for e in ${entries[@]+"${entries[@]}"}; do
        e=${e//[[:space:]]/}
        [[ -n $e ]] || break
        row=-1
        if [[ $e =~ ^[0-9]+$ ]]; then
            for ((r = 0; r < ${#idx[@]}; r++)); do
                if ((idx[r] == 10#$e)); then row=$r; fi
            done
        else
            load_uuids
            want_uuid=${e#GPU-} hits=()
            for ((r = 0; r < ${#idx[@]}; r++)); do
                if [[ -n ${uuids[r]} && ${uuids[r]#GPU-} == "$want_uuid"* ]]; then hits+=("$r"); fi
            done
            if ((${#hits[@]} == 1)); then row=${hits[0]}; fi
        fi
        dup=0
        for c in ${cand[@]+"${cand[@]}"}; do
            if ((c == row)); then dup=1; fi
        done
        if ((row < 0 || dup)); then
            cvd_note=" (CUDA reads it only up to '$e')"
            break
        fi
        cand+=("$row")
    done
    ((${#cand[@]})) ||
        die "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' selects none of this box's GPUs (nvidia-smi lists ${idx[*]}); unset it or name some of them"
else
    for ((r = 0; r < ${#idx[@]}; r++)); do cand+=("$r"); done
fi

# position of each row among the candidates (-1: not a candidate)
pos=()
for ((r = 0; r < ${#idx[@]}; r++)); do pos+=(-1); done
for ((k = 0; k < ${#cand[@]}; k++)); do pos[cand[k]]=$k; done

describe() { # "GPU 3 (2048/81559 MiB, 97% util)", with its CUDA_VISIBLE_DEVICES position if any
    local r=$1 where=""
    if [[ -v CUDA_VISIBLE_DEVICES ]] && ((pos[r] >= 0)); then where=", visible as ${pos[r]}"; fi
    local u=${util[r]}
    if [[ $u =~ ^[0-9]+$ ]]; then u="$u% util"; else u="util $u"; fi
    echo "GPU ${idx[r]} (${used[r]}/${total[r]} MiB, $u$where)"
}

# Why each candidate is busy ("" = idle), and the idle ones as "util mem row" for sorting.
why=() idle_keys=()
for ((r = 0; r < ${#idx[@]}; r++)); do
    reasons=()
    if ((pos[r] < 0)); then
        reasons+=("not in CUDA_VISIBLE_DEVICES")
    else
        if ! [[ ${used[r]} =~ ^[0-9]+$ ]]; then
            reasons+=("memory use unknown")
        elif ((10#${used[r]} > max_mem)); then
            reasons+=("memory used ${used[r]} MiB > $max_mem MiB")
        fi
        if [[ ${util[r]} =~ ^[0-9]+$ ]] && ((10#${util[r]} > max_util)); then
            reasons+=("utilization ${util[r]}% > $max_util%")
        fi
    fi
    joined=""
    for reason in ${reasons[@]+"${reasons[@]}"}; do joined+="${joined:+, }$reason"; done
    why+=("$joined")
    if [[ -z $joined ]]; then
        ukey=${util[r]}
        [[ $ukey =~ ^[0-9]+$ ]] || ukey=0
        idle_keys+=("$((10#$ukey)) $((10#${used[r]})) $r")
    fi
done
n_idle=${#idle_keys[@]}
rule="idle = memory used <= $max_mem MiB and utilization <= $max_util%"
if [[ -v CUDA_VISIBLE_DEVICES ]]; then rule+="; candidates: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES$cvd_note"; fi

if [[ $want == auto ]]; then need=1; else need=$want; fi
if ((n_idle < need)); then
    if [[ $want == auto ]]; then
        echo "$me: error: no GPU is idle ($rule):" >&2
    else
        echo "$me: error: -n $want needs $want idle GPUs, but only $n_idle of ${#idx[@]} are idle ($rule):" >&2
    fi
    for ((r = 0; r < ${#idx[@]}; r++)); do
        echo "$me:   $(describe "$r"): ${why[r]:-idle}" >&2
    done
    hint="wait for the busy GPUs (nvidia-smi shows who uses them)"
    if ((n_idle > 0)); then hint+=", ask for fewer (-n $n_idle)"; fi
    echo "$me:   $hint, or raise --max-mem-mib / --max-util" >&2
    exit 2
fi
if [[ $want == auto ]]; then take=$n_idle; else take=$want; fi

# The least used first; launch then gets their ids in ascending order (rank order).
picked_rows=()
while read -r _ _ r; do
    picked_rows+=("$r")
done < <(printf '%s\n' "${idle_keys[@]}" | sort -n -k1,1 -k2,2 -k3,3 | head -n "$take")

# launch's id of a row: its nvidia-smi index, or its position in CUDA_VISIBLE_DEVICES
gpu_id() {
    if [[ -v CUDA_VISIBLE_DEVICES ]]; then echo "${pos[$1]}"; else echo "${idx[$1]}"; fi
}
ids="" picked_desc=""
declare -A is_picked=()
while read -r _ r; do
    is_picked[$r]=1
    ids+="${ids:+,}$(gpu_id "$r")"
    picked_desc+="${picked_desc:+, }$(describe "$r")"
done < <(for r in "${picked_rows[@]}"; do echo "$(gpu_id "$r") $r"; done | sort -n -k1,1)
others=""
for ((r = 0; r < ${#idx[@]}; r++)); do
    [[ -n ${is_picked[$r]:-} ]] && continue
    others+="${others:+; }$(describe "$r"): ${why[r]:-idle, but -n $want takes the $take least used}"
done
if [[ $want == auto ]]; then
    how="every idle GPU (-n auto)"
else
    how="the $take least used of $n_idle idle GPUs (-n $want)"
fi
echo "$me: picked $picked_desc: $how; $rule" >&2
[[ -z $others ]] || echo "$me: not picked: $others" >&2

# --- logs and launch ------------------------------------------------------------------------------
stem=$(basename -- "$config")
stem=${stem%.*}
log_parent=${LOG_ROOT:-$repo/logs}/$stem
mkdir -p -- "$log_parent" || die "cannot create the log directory $log_parent"
stamp=$(date +%Y%m%d-%H%M%S)
log_dir=$log_parent/$stamp
k=1
until mkdir -- "$log_dir" 2>/dev/null; do # two runs in the same second get -2, -3, ...
    [[ -e $log_dir ]] || die "cannot create the log directory $log_dir"
    k=$((k + 1))
    log_dir=$log_parent/$stamp-$k
done
echo "$me: logs go to $log_dir/rank-N.log" >&2

cmd=("$launch" --gpu-ids "$ids" --rank-logs "$log_dir" "$config" "$@")
shown=""
for arg in "${cmd[@]}"; do # the command as one could paste it
    if [[ $arg =~ ^[A-Za-z0-9_./,:=@%+-]+$ ]]; then shown+=" $arg"; else shown+=" $(printf '%q' "$arg")"; fi
done
echo "$me: exec$shown" >&2
exec "${cmd[@]}"
