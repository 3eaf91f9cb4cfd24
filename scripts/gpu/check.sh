#!/usr/bin/env bash
# The GPU check of the whole project (issue "On a lent GPU"): runs, on a machine with one or more
# NVIDIA GPUs and PyTorch 2.11.0 but no Rust, every path that only a GPU takes, and prints what
# each measured. Binaries built elsewhere are pointed at this machine's libtorch and NCCL.
#
#   GPTREC_BIN   directory holding launch, worker and gen-data (default: target/release)
#   CHECK_OUT    where the runs and logs go (default: $OUT/gpu-check when OUT is set, else a
#                fresh temporary directory); every step's full output is in CHECK_OUT/NAME.log
#   SIZES        data sizes of the vs_peer step (default: small full)
#   CHECK_BACKEND, PEER_DEVICE   nccl and cuda (defaults); tcp and cpu try the script on a CPU
#   STEPS        which steps to run (default: all, in this order): env dry default dynamic
#                precision oom probe auto two nccl_two zero offload ml100k vs_peer_gpt2 vs_peer
#   ZERO_STAGES  the stages of the zero step (default: 0 1 2 3; 0 is DDP, the reference)
#   ML100K       MovieLens-100k's directory (u.data, u.item, u.user) for the ml100k step
#                (default: ~/.cache/gptrec/data/ml-100k, where scripts/data/ml100k.sh puts it;
#                on a lent machine, a copy carried with the checkout); skipped without it
#   GPT2_MICROS  micro batches of the vs_peer_gpt2 step (default "192 1536": 192 and the
#                largest of these that fits both sides on an 80 GB card)
#
# Each step has its own time limit and the script goes on after a failed step; a step's
# result line starts with "== NAME" and says "ok" or "FAILED (exit N)".
set -u
cd "$(dirname "$0")/../.."
repo=$PWD
bin=$(cd "${GPTREC_BIN:-target/release}" 2>/dev/null && pwd)
if [ ! -x "$bin/launch" ] || [ ! -x "$bin/worker" ]; then
  echo "check.sh: error: no launch and worker in ${GPTREC_BIN:-target/release}; build them (cargo build --release) or set GPTREC_BIN" >&2
  exit 2
fi
out=${CHECK_OUT:-${OUT:+$OUT/gpu-check}}
out=${out:-$(mktemp -d)}
mkdir -p "$out"
steps=${STEPS:-env dry default dynamic precision oom probe auto two nccl_two zero offload ml100k vs_peer_gpt2 vs_peer}
python=${PYTHON:-python3}
launch="$bin/launch"
. scripts/bench/summary.sh

# libtorch and NCCL from this machine's PyTorch, when the binaries' own run path is not here.
torch_lib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)
nccl_so=$("$python" -c 'import glob, os, nvidia.nccl as n; print(glob.glob(os.path.join(list(n.__path__)[0], "lib", "libnccl.so*"))[0])' 2>/dev/null)
mkdir -p "$out/nccl-lib"
[ -n "$nccl_so" ] && ln -sf "$nccl_so" "$out/nccl-lib/libnccl.so"
export LD_LIBRARY_PATH="${torch_lib:+$torch_lib:}$out/nccl-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export RUST_LOG=${RUST_LOG:-info}
cd "$out"

# step NAME LIMIT_S COMMAND...: runs COMMAND into NAME.log with a time limit, says how it ended.
step() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s%N)
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "== $name: $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)") in $((($(date +%s%N) - start) / 1000000)) ms"
  return $rc
}

# The lines of a run's log worth reading here: device, plan, summary, memory, errors.
digest() {
  grep -a -E 'device|batch.micro|micro [0-9]+ x|summary:|memory:|estimate|peak|error|warning|out of memory|root cause|exits with|ndcg@10:|NCCL|nccl|activation|bf16|  libtorch said|nearest plans|exit code|time per step|    rank [0-9]+: ' "$out/$1.log" \
    | grep -a -v ' INFO epoch .* step ' | cut -c1-400 | head -"${2:-40}"
}

# An NVML sampler of this job's GPU memory (every process, 100 ms), for the peak seen from outside.
smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$out/$1.smi" 2>/dev/null & smi_pid=$!; }
smi_stop() {
  kill "$smi_pid" 2>/dev/null
  wait "$smi_pid" 2>/dev/null
  echo "   NVML memory.used on the GPU, max over the run: $(sort -n "$out/$1.smi" | tail -1) MiB (before: $(head -1 "$out/$1.smi") MiB)"
}

# run NAME LIMIT LAUNCH_ARGS...: a training run of ours with the sampler and its digest.
run() {
  local name=$1 limit=$2
  shift 2
  smi_start "$name"
  step "$name" "$limit" "$launch" --master-port 0 "$@" --set run.output_dir=\""$out/runs"\" \
    --set run.name=\""$name"\" --set checkpoint.resume=\"never\"
  local rc=$?
  smi_stop "$name"
  digest "$name"
  return $rc
}

backend=${CHECK_BACKEND:-nccl}
# BPR with ID users, as the PyTorch peers train (configs/default.toml ships the softmax).
base=("$repo/configs/default.toml" --set dist.backend=\"$backend\" --set train.loss=\"bpr\" --set model.user_tower=\"id\")
dyn=("$repo/configs/dynamic.toml" --set dist.backend=\"$backend\")
# configs/default.toml as it ships (the full softmax over users seen through their history).
shipped=("$repo/configs/default.toml" --set dist.backend=\"$backend\")
# GPT-2 small (124M, random weights), every block training, on the tiny data (about 3,600 samples an epoch).
gpt2=(--set model.preset=\"gpt2\" --set model.trainable_layers=12 --set data.synthetic=\"tiny\" --set train.epochs=2 --set eval.patience=0)
gpt2auto=("${gpt2[@]}" --set batch.max_micro=192)

# Several NCCL ranks on one GPU: two launches as two nodes, each its own NCCL_HOSTID (so NCCL's
# duplicate-GPU check passes), over loopback.
two_nodes() { # NAME LIMIT EXTRA_ENV... -- LAUNCH_ARGS...: both nodes' logs NAME-n0/n1.log
  local name=$1 limit=$2 port id envs=() node
  shift 2
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  port=$((29000 + RANDOM % 2000)); id=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
  for node in 0 1; do
    env ${envs[@]+"${envs[@]}"} CUDA_VISIBLE_DEVICES=0 NCCL_HOSTID="gptrec-check-$node" NCCL_SOCKET_IFNAME=lo \
      NCCL_IB_DISABLE=1 LAUNCH_RUN_ID="$id" timeout -k 5 "$limit" "$launch" --nnodes 2 --node-rank $node \
      --num-processes 1 --master-addr 127.0.0.1 --master-port $port "$@" \
      --set run.output_dir=\""$out/runs-n$node"\" --set run.name=\""$name"\" --set checkpoint.resume=\"never\" \
      >"$out/$name-n$node.log" 2>&1 &
  done
  wait
  echo "== $name: node 0 $(tail -1 "$out/$name-n0.log" | cut -c1-150)"
  echo "   node 1 $(tail -1 "$out/$name-n1.log" | cut -c1-150)"
}
small=(--set data.synthetic=\"tiny\" --set train.epochs=2 --set eval.patience=0)

for s in $steps; do
  case $s in
  env)
    step env 60 bash -c "nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv; \
      $python -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", torch.cuda.nccl.version(), torch.cuda.get_device_name(0))'; \
      echo LD_LIBRARY_PATH=\$LD_LIBRARY_PATH; ldd $bin/worker | grep -E 'not found|torch|c10' ; nproc"
    cat "$out/env.log"
    ;;
  dry)
    step dry 60 "$launch" --num-processes auto --dry-run "${base[@]}" --set batch.micro=\"auto\"
    grep -a -v '^\s*$' "$out/dry.log" | head -60
    ;;
  default)
    # The built-in default as it ships on one GPU, nccl backend, micro chosen by the probe.
    run default 120 --num-processes auto "${shipped[@]}" --set batch.micro=\"auto\"
    [ -f "$out/runs/default/memory.json" ] && head -c 3000 "$out/runs/default/memory.json" && echo
    ;;
  dynamic)
    run dynamic-tiny 120 --num-processes 1 "${dyn[@]}" --set train.epochs=1
    run dynamic-gpt2 180 --num-processes 1 "${dyn[@]}" "${gpt2auto[@]}"
    ;;
  precision)
    # bf16 autocast and activation checkpointing on GPT-2 small, against dynamic-gpt2 above.
    run dynamic-gpt2-bf16 180 --num-processes 1 "${dyn[@]}" "${gpt2auto[@]}" --set train.bf16=true
    run dynamic-gpt2-ckpt 180 --num-processes 1 "${dyn[@]}" "${gpt2auto[@]}" --set model.activation_checkpointing=true
    ;;
  oom)
    # A real CUDA out-of-memory in training: a micro batch far beyond the card (all 12 blocks train).
    GPTREC_MEMORY_LIMIT_MB=100000000 run oom-train 120 --num-processes 1 --force "${base[@]}" "${gpt2[@]}" \
      --set model.text_mode=\"dynamic\" --set model.max_text_tokens=32 \
      --set batch.global=3072 --set batch.micro=3072
    ;;
  probe)
    # A real out-of-memory in the auto-micro probe: the planner is told the card is huge, so the
    # probe's first candidates really fail and it moves on to smaller ones.
    GPTREC_MEMORY_LIMIT_MB=100000000 run oom-probe 180 --num-processes 1 --force "${dyn[@]}" "${gpt2[@]}" \
      --set batch.global=3072 --set batch.max_micro=3072 --set train.epochs=1
    ;;
  auto)
    # batch.micro = "auto" on the real card alone: the largest micro the estimate allows, probed.
    run auto-gpt2 180 --num-processes 1 "${dyn[@]}" "${gpt2[@]}" \
      --set batch.global=3072 --set batch.max_micro=3072 --set train.epochs=1
    ;;
  two)
    # Two ranks of one launch on one visible GPU: each process sees one GPU, so both take it (as
    # under Slurm's per-task binding); NCCL refuses a communicator holding one GPU twice, and the
    # worker must say so at once, naming NCCL's own error.
    run two-on-one 60 --num-processes 2 "${base[@]}" --set data.synthetic=\"tiny\" ||
      { grep -a -E 'NCCL|nccl' "$out/two-on-one.log" | grep -a -i -E 'error|duplicate' | head -3
        echo "   refused as it should be: one GPU twice in one communicator"; }
    ;;
  nccl_two)
    # Several NCCL ranks on one GPU: two launches as two nodes, each its own NCCL_HOSTID (so
    # NCCL's duplicate-GPU check passes), over loopback: the unique-id exchange, multi-rank
    # non-blocking init, non-root broadcast, all-gather, averaging, the row-sparse exchange of
    # CUDA gradients and NCCL's own stream, against the same two ranks over the TCP ring on the
    # same GPU (the same computation, another transport: losses equal within 1e-5, relative).
    # Then a killed rank and a stopped rank, as on the CPU (the stopped rank's node is ended
    # by the time limit, as a scheduler would end it).
    two_nodes tcp-two 180 -- "${base[@]}" "${small[@]}" --set dist.backend=\"tcp\"
    two_nodes nccl-two 180 -- "${base[@]}" "${small[@]}"
    digest nccl-two-n0 20
    "$python" - "$out/runs-n0/tcp-two/metrics.jsonl" "$out/runs-n0/nccl-two/metrics.jsonl" <<'PY'
import json, sys
def losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if r.get("kind") == "step"]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)) if a and len(a) == len(b) else None
print(f"   losses of 2 ranks over tcp vs over NCCL on one GPU: {len(a)} and {len(b)} steps, largest relative difference {worst}",
      "ok" if worst is not None and worst <= 1e-5 else "DIFFERENT")
PY
    # NCCL's own buffers (outside libtorch's allocator, in NVML's per-process figure): the
    # same job's device peak over NCCL less over tcp, against the estimate's NCCL term.
    "$python" - "$out/runs-n0/tcp-two/metrics.jsonl" "$out/runs-n0/nccl-two/metrics.jsonl" "$out/runs-n0/nccl-two/memory.json" <<'PY'
import json, sys
peak = lambda path: (next(r for r in map(json.loads, open(path)) if r.get("kind") == "summary")["peak_device_mib"] or [None])[0]
tcp, nccl = peak(sys.argv[1]), peak(sys.argv[2])
if tcp is None or nccl is None:
    sys.exit("   no device memory figures (not on a GPU)")
terms = json.load(open(sys.argv[3]))["estimate"]["terms"]
term = next((t["mib"] for t in terms if t["name"] == "NCCL buffers"), 0.0)
print(f"   device peak per rank: tcp {tcp} MiB, nccl {nccl} MiB: NCCL's own {nccl - tcp:.0f} MiB; the estimate's NCCL term {term:.0f} MiB")
PY
    two_nodes nccl-two-killed 120 GPTREC_FAULT_DIE=3@1 -- "${base[@]}" "${small[@]}"
    grep -a -h -E 'stopping: rank 1|ended before the job finished|root cause' "$out"/nccl-two-killed-n*.log | head -3
    two_nodes nccl-two-stopped 60 GPTREC_FAULT_STOP=3@1 -- "${base[@]}" "${small[@]}" --set dist.timeout_s=20
    grep -a -h -E 'timed out|no answer from rank|stopped' "$out"/nccl-two-stopped-n*.log | head -3
    ;;
  offload)
    # dist.offload = "optimizer" on GPT-2 small (every block training) alone on the GPU: the
    # device keeps no AdamW moments (about 1 GiB less at 124M values) and the update runs on
    # the host's threads. The losses against the same run without offload (the device's fused
    # AdamW kernel and the host's loop agree to float rounding, not bit for bit), each run's
    # device peak and its estimate, and samples/s.
    for o in none optimizer; do
      OMP_NUM_THREADS=$(nproc) run offload-$o 240 --num-processes 1 "${dyn[@]}" "${gpt2[@]}" \
        --set batch.global=64 --set batch.micro=64 --set train.epochs=1 --set dist.offload=\"$o\"
      grep -a -E 'AdamW moments in host memory|optimizer \(AdamW\)|optimizer temporaries' "$out/offload-$o.log" | head -3
    done
    "$python" - "$out/runs/offload-none/metrics.jsonl" "$out/runs/offload-optimizer/metrics.jsonl" <<'PY'
import json, sys
recs = [list(map(json.loads, open(p))) for p in sys.argv[1:]]
steps = [[r["loss"] for r in rs if r.get("kind") == "step"] for rs in recs]
summ = [next(r for r in rs if r.get("kind") == "summary") for rs in recs]
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(*steps)) if steps[0] and len(steps[0]) == len(steps[1]) else None
print(f"   offload vs not: {len(steps[0])} steps, largest relative loss difference {worst}", "ok" if worst is not None and worst <= 1e-3 else "DIFFERENT")
for name, s in zip(["none", "optimizer"], summ):
    print(f"   offload {name}: device peak {s.get('peak_device_mib')} MiB, samples/s {s.get('samples_per_s')}")
peaks = [(s.get("peak_device_mib") or [None])[0] for s in summ]
if None not in peaks:
    # GPT-2 small's 124M values: 8 bytes each of moments, about 950 MiB, and the update's temporaries.
    print(f"   device peak {peaks[0] - peaks[1]:.0f} MiB lower offloaded", "ok" if peaks[0] - peaks[1] >= 700 else "NOT LOWER")
PY
    ;;
  zero)
    # Issue 55 on NCCL: ZeRO stages 1-3 against DDP (stage 0), two ranks sharing the GPU as
    # two nodes, BPR with GPT-2 tiny training (dynamic text), gradient accumulation and
    # clipping: every step's loss equal to DDP's bit for bit, the device peak per rank and the
    # MiB each rank sends a step.
    for z in ${ZERO_STAGES:-0 1 2 3}; do
      two_nodes zero-$z 240 -- "${base[@]}" "${small[@]}" --set model.text_mode=\"dynamic\" \
        --set dist.zero=$z --set batch.grad_accum=2 --set train.max_grad_norm=0.5
    done
    "$python" - "$out/runs-n0" ${ZERO_STAGES:-0 1 2 3} <<'PY'
import json, os, sys
def records(stage):
    path = os.path.join(sys.argv[1], f"zero-{stage}", "metrics.jsonl")
    return list(map(json.loads, open(path))) if os.path.exists(path) else []
stages = sys.argv[2:] or ["0"]
base = [r["loss"] for r in records(stages[0]) if r.get("kind") == "step"]
if not base:
    print(f"   stage {stages[0]}: no steps recorded; nothing to compare with")
for z in stages:
    recs = records(z)
    losses = [r["loss"] for r in recs if r.get("kind") == "step"]
    summary = next((r for r in recs if r.get("kind") == "summary"), {})
    same = "equal" if losses and losses == base else f"DIFFERENT ({len(losses)} steps)"
    print(f"   stage {z}: {len(losses)} steps, losses {same} to stage {stages[0]}'s; device peak "
          f"{summary.get('peak_device_mib')} MiB; sent {summary.get('sent_mib_per_step')} MiB a step")
PY
    ;;
  ml100k)
    # Issue 54's time on a GPU: configs/ml-100k.toml as it ships (the full softmax, the history
    # tower, the item-item matrix) on the split of seed 42 without cold shares, one process, in
    # f32 (TF32) and bf16; then the gpt2rec of before the softmax (BPR, ID users, 64 wide,
    # scripts/bench/ablation.sh's) for the same 20 epochs: the time of the same epochs, now
    # against then (the issue allows 2x).
    d=${ML100K:-$HOME/.cache/gptrec/data/ml-100k}
    if [ ! -f "$d/u.data" ]; then
      echo "== ml100k: skipped: no MovieLens-100k in $d (set ML100K)"
      continue
    fi
    ml=("$repo/configs/ml-100k.toml" --set dist.backend=\"$backend\" --set data.dir=\"$d\"
      --set data.cold_items=0 --set data.cold_users=0 --set data.split_seed=42)
    before=(--set train.loss=\"bpr\" --set model.user_tower=\"id\" --set model.item_item=false
      --set model.embedding_dim=64 --set train.lr=1e-3 --set model.l2=0 --set train.weight_decay=0.0
      --set model.text_l2=1e-2)
    run ml100k-f32 300 --num-processes 1 "${ml[@]}" | grep -a -E '^== |ndcg@10:'
    run ml100k-bf16 300 --num-processes 1 "${ml[@]}" --set train.bf16=true | grep -a -E '^== |ndcg@10:'
    run ml100k-before 300 --num-processes 1 "${ml[@]}" "${before[@]}" | grep -a -E '^== |ndcg@10:'
    "$python" - "$out/runs" <<'PY'
import json, os, sys
rows = {}
for name in ["ml100k-f32", "ml100k-bf16", "ml100k-before"]:
    path = os.path.join(sys.argv[1], name, "metrics.jsonl")
    if not os.path.exists(path):
        print(f"   {name}: no metrics"); continue
    recs = list(map(json.loads, open(path)))
    s = next((r for r in recs if r.get("kind") == "summary"), {})
    test = next((r for r in recs if r.get("kind") == "eval" and r.get("split") == "test"), {})
    rows[name] = (s.get("seconds") or {}).get("total")
    step = sum(v or 0 for v in (s.get("steady_time_per_step_ms") or {}).values())
    took = f"{rows[name]:.1f}" if rows[name] is not None else "?"
    print(f"   {name}: {s.get('epochs')} epochs in {took} s, {step:.1f} ms a step, "
          f"test NDCG@10 {test.get('ndcg@10')}, Recall@10 {test.get('recall@10')}")
if rows.get("ml100k-f32") and rows.get("ml100k-before"):
    print(f"   the shipped config's run over the one of before, the same 20 epochs: "
          f"{rows['ml100k-f32'] / rows['ml100k-before']:.2f}x (the issue allows 2x)")
PY
    ;;
  vs_peer_gpt2)
    # GPT-2 small, 12 blocks training, against PyTorch + transformers on the same step (the
    # same initial weights, texts and batches; the script stops if the two losses differ), in
    # bf16, TF32 and f32: steady-state samples/s, ms per phase, MFU.
    GPTREC_BIN=$bin PYTHON=$python PEER_DEVICE=${PEER_DEVICE:-cuda} PRESET=gpt2 PRECISION="bf16 tf32 f32" \
      MICRO="${GPT2_MICROS:-192 1536}" BENCH_OUT="$out/vs-peer-gpt2" \
      step vs-peer-gpt2 900 bash "$repo/scripts/bench/vs_pytorch_gpt2.sh"
    grep -a -E '^\||parity|steady steps' "$out/vs-peer-gpt2.log"
    ;;
  vs_peer)
    # Ours against the plain PyTorch eager DDP script on the same GPU (as scripts/bench/vs_pytorch.sh).
    echo "| data | model | ours (samples/s) | PyTorch eager nccl (samples/s) | ours / PyTorch | ours: estimate / measured peak |"
    echo "|---|---|---|---|---|---|"
    for size in ${SIZES:-small full}; do
      [ -f "$out/data-$size/ratings.dat" ] || "$bin/gen-data" --size $size "$out/data-$size" >/dev/null
      epochs=1
      for model in bpr cached; do
        kind=gpt2rec
        [ $model = bpr ] && kind=bpr
        name=ours-$size-$model
        run $name 180 --num-processes 1 "${base[@]}" \
          --set data.dir=\""$out/data-$size"\" --set model.kind=\"$kind\" --set model.text_mode=\"cached\" \
          --set train.epochs=$epochs --set eval.patience=0 --set batch.global=256 --set batch.micro=64 | grep -a '^== ' 
        ours=$(PYTHON=$python summary_samples_per_s "$out/runs/$name" 2>/dev/null)
        mem=$(grep -a -o 'estimated peak .*' "$out/$name.log" | head -1 | cut -c1-120)
        PEER_DEVICE=${PEER_DEVICE:-cuda} step peer-$size-$model 240 "$launch" --num-processes 1 --master-port 0 -- \
          "$python" "$repo/scripts/bench/ddp_peer.py" "$out/data-$size" $model $epochs 256 64
        peer=$(sed -n -E 's/.*peer samples\/s ([0-9]+).*/\1/p' "$out/peer-$size-$model.log" | head -1)
        ratio=$("$python" -c "print(f'{$ours/$peer:.2f}x')" 2>/dev/null)
        echo "| $size | $model | ${ours:-?} | ${peer:-?} | ${ratio:-?} | ${mem:-?} |"
      done
    done
    ;;
  *) echo "unknown step $s" ;;
  esac
done
echo "logs in $out"
