#!/usr/bin/env bash
# Our dynamic GPT-2 recommender's training step against a plain PyTorch + transformers DDP script
# of the same step (scripts/bench/gpt2_peer.py; what it mirrors is in its header), in one go:
# ours trains with GPTREC_DUMP_PEER (its initial variables, token tables, training pairs and a
# micro batch with our eval-mode loss on it, written before the first step), then the peer loads
# that dump, checks that its loss on the micro batch equals ours (it stops the script if not) and
# trains on the same texts, batch sizes and hyper-parameters. Both are started by our `launch`.
# One markdown row per side, precision and micro batch: training samples/s in the steady state
# (after WARMUP steps; evaluation and checkpoints excluded), ms per step by phase and, on a GPU,
# the MFU.
#
# Usage: [ENV=...] scripts/bench/vs_pytorch_gpt2.sh
#   PEER_DEVICE  cpu (default; OMP_NUM_THREADS=1 unless set) or cuda (both sides on the GPUs)
#   PRESET       GPT-2: tiny (default) or gpt2 (124M)
#   PRECISION    f32, tf32, bf16 (autocast), or several ("bf16 tf32 f32"); default f32. On the
#                CPU f32 or bf16 (both sides under the CPU's autocast; TF32 is CUDA's).
#   MICRO        micro batch(es), e.g. "192 384" (default 16)
#   GLOBAL       global batch (default MICRO x PROCS: no accumulation)
#   PROCS        processes (default 1)
#   EPOCHS       our epochs (default 1); SIZE synthetic data size (tiny, small, full; default
#                tiny on the CPU, small on CUDA) or DATA an ML-1M directory; TOKENS
#                model.max_text_tokens (default the config's); TRAINABLE_LAYERS
#                model.trainable_layers (default: every block)
#   PEER_STEPS   the peer's timed steps (default: as many as our steady steps, at most 50 on
#                the CPU, 100 on CUDA)
#   WARMUP       steps left out of both sides' steady state (default 3, as our summary)
#   PEAK_TFLOPS  the device's dense peak for the precision (default from the GPU's name: H100
#                SXM and H200 989 bf16 / 494 tf32 / 67 f32, H100 PCIe 756 / 378 / 51)
#   GPTREC_BIN   prebuilt launch, worker and gen-data (no set-up, no build; PYTHON: the
#                interpreter with torch and transformers); BENCH_OUT where the runs go
#
# MFU = samples/s x FLOPs per sample / (peak x processes), FLOPs per sample from the real
# tokens (padding is not useful work): over the 3 texts of a sample (user, positive, negative),
# (6 P_trained + 2 P_frozen) len + (12 L_trained + 4 L_frozen) d len^2, with P GPT-2's
# non-embedding parameters in trained / frozen blocks, L the blocks, d the width, len the text's
# real tokens (the peer computes it from the dumped tables and prints it; activation
# checkpointing's recomputation is not counted).
set -eu
cd "$(dirname "$0")/../.."

die() {
  echo "vs_pytorch_gpt2.sh: error: $*" >&2
  exit 2
}
whole() { # NAME VALUE: a whole number >= 1
  case $2 in '' | *[!0-9]* | 0*) die "$1=$2: expected a whole number >= 1" ;; esac
}
device=${PEER_DEVICE:-cpu}
preset=${PRESET:-tiny}
precisions=${PRECISION:-f32}
micros=${MICRO:-16}
procs=${PROCS:-1}
epochs=${EPOCHS:-1}
size=${SIZE:-$([ "$device" = cuda ] && echo small || echo tiny)}
warmup=${WARMUP:-3}
case $device in cpu | cuda) ;; *) die "PEER_DEVICE=$device: expected cpu or cuda" ;; esac
case $preset in tiny | gpt2) ;; *) die "PRESET=$preset: expected tiny or gpt2" ;; esac
case $size in tiny | small | full) ;; *) die "SIZE=$size: expected tiny, small or full" ;; esac
for p in $precisions; do
  case $p in f32 | tf32 | bf16) ;; *) die "PRECISION=$p: expected f32, tf32 or bf16" ;; esac
  [ "$device" = cuda ] || [ "$p" != tf32 ] \
    || die "PRECISION=tf32 needs PEER_DEVICE=cuda: TF32 is a CUDA matmul mode (train.tf32 applies to CUDA only)"
done
[ -n "$precisions" ] || die "PRECISION is empty: expected f32, tf32 or bf16"
[ -n "$micros" ] || die "MICRO is empty"
for m in $micros; do whole MICRO "$m"; done
whole PROCS "$procs"
whole EPOCHS "$epochs"
[ -z "${GLOBAL:-}" ] || whole GLOBAL "$GLOBAL"
[ -z "${PEER_STEPS:-}" ] || whole PEER_STEPS "$PEER_STEPS"
[ -z "${TOKENS:-}" ] || whole TOKENS "$TOKENS"
case $warmup in '' | *[!0-9]*) die "WARMUP=$warmup: expected a whole number" ;; esac
[ -z "${TRAINABLE_LAYERS:-}" ] || case $TRAINABLE_LAYERS in *[!0-9]*) die "TRAINABLE_LAYERS=$TRAINABLE_LAYERS: expected a whole number" ;; esac
[ -z "${DATA:-}" ] || [ -f "$DATA/ratings.dat" ] || die "DATA=$DATA: no ratings.dat there (an ML-1M directory)"
[ -z "${PEAK_TFLOPS:-}" ] || python3 -c 'import sys; assert float(sys.argv[1]) > 0' "$PEAK_TFLOPS" 2>/dev/null \
  || die "PEAK_TFLOPS=$PEAK_TFLOPS: expected a positive number"

if [ -n "${GPTREC_BIN:-}" ]; then
  bin=$(cd "$GPTREC_BIN" 2>/dev/null && pwd) || die "GPTREC_BIN=$GPTREC_BIN: no such directory"
  [ -x "$bin/launch" ] && [ -x "$bin/worker" ] || die "GPTREC_BIN=$GPTREC_BIN: no launch and worker there"
  launch="$bin/launch"
  python=${PYTHON:-python3}
  out="${BENCH_OUT:-$(mktemp -d)}"
  mkdir -p "$out"
  echo "runs in $out"
else
  . scripts/bench/lib.sh
  python=${PYTHON:-python}
fi
"$python" -c 'import torch, transformers, safetensors' 2>/dev/null \
  || die "$python cannot import torch, transformers and safetensors (run scripts/setup.sh, or set PYTHON)"
[ "$device" = cpu ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PEER_DEVICE=$device

# The config both sides share (the peer reads it from our dump).
data_set=(--set data.synthetic=\""$size"\")
[ -n "${DATA:-}" ] && data_set=(--set data.dir=\""$DATA"\")
model_set=(--set model.text_mode=\"dynamic\" --set model.preset=\""$preset"\")
[ -n "${TOKENS:-}" ] && model_set+=(--set model.max_text_tokens="$TOKENS")
[ -n "${TRAINABLE_LAYERS:-}" ] && model_set+=(--set model.trainable_layers="$TRAINABLE_LAYERS")

ours() { # name precision micro global dump
  local name=$1 precision=$2 micro=$3 global=$4 dump=$5 bf16=false tf32=false
  [ "$precision" = bf16 ] && bf16=true
  [ "$precision" != f32 ] && tf32=true
  rm -rf "$dump"
  if ! GPTREC_DUMP_PEER="$dump" "$launch" --num-processes "$procs" --master-port 0 configs/default.toml \
    --set train.loss=\"bpr\" --set model.user_tower=\"id\" \
    --set run.output_dir=\""$out"\" --set run.name=\""$name"\" "${data_set[@]}" "${model_set[@]}" \
    --set train.epochs="$epochs" --set train.bf16="$bf16" --set train.tf32="$tf32" \
    --set checkpoint.resume=\"never\" --set eval.patience=0 \
    --set batch.global="$global" --set batch.micro="$micro" >"$out/$name.log" 2>&1; then
    echo "$name failed: see $out/$name.log" >&2
    tail -3 "$out/$name.log" >&2
    exit 1
  fi
}

# Our steady state from the run's own records: each step record's samples/s is the global batch
# over that step's wall time, so the steps after WARMUP give samples/s and ms per step; the
# phases are the summary's time per step after its own 3 warm-up steps (rank 0's,
# `steady_time_per_step_ms`; the mean over the ranks of every step where a run has no steady
# state). Prints: steady samples/s,
# ms/step, steady steps, data, compute, collective, update ms.
ours_figures() { # run_dir global
  "$python" - "$1/metrics.jsonl" "$2" "$warmup" <<'PY'
import json, sys
path, global_batch, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
records = [json.loads(line) for line in open(path)]
steps = sorted((r for r in records if r.get("kind") == "step"), key=lambda r: r["step"])[warmup:]
if not steps:
    sys.exit(f"{path}: no step after the {warmup} warm-up steps: train longer (EPOCHS) or on more data")
secs = sum(global_batch / r["samples_per_s"] for r in steps)
summary = next(r for r in records if r.get("kind") == "summary")
ranks = [summary["steady_time_per_step_ms"]] if summary.get("steady_time_per_step_ms") else summary["time_per_step_ms"]
mean = lambda key: sum(t[key] for t in ranks) / len(ranks)
print(f"{len(steps) * global_batch / secs:.1f} {secs * 1000 / len(steps):.3f} {len(steps)} "
      f"{mean('data'):.3f} {mean('compute'):.3f} {mean('collective'):.3f} {mean('update'):.3f}")
PY
}

peer() { # name dump steps precision
  local name=$1 dump=$2 steps=$3 precision=$4
  if ! PRECISION="$precision" WARMUP="$warmup" "$launch" --num-processes "$procs" --master-port 0 -- \
    "$python" scripts/bench/gpt2_peer.py "$dump" "$steps" >"$out/$name.log" 2>&1; then
    echo "$name failed: see $out/$name.log" >&2
    grep -a -E "peer parity|error" "$out/$name.log" | tail -3 >&2
    exit 1
  fi
}

# The device's dense peak (TFLOP/s) for a precision: PEAK_TFLOPS, else from the GPU's name; empty
# when unknown (no MFU).
peak() { # precision
  [ -n "${PEAK_TFLOPS:-}" ] && { echo "$PEAK_TFLOPS"; return; }
  [ "$device" = cuda ] || return 0
  "$python" - "$1" <<'PY'
import sys, torch
name = torch.cuda.get_device_name(0)
table = [("H100 PCIe", (756, 378, 51)), ("H100 NVL", (835, 418, 60)), ("H100", (989, 494, 67)),
         ("H200", (989, 494, 67))]
peaks = next((p for key, p in table if key in name), None)
if peaks:
    print(dict(zip(("bf16", "tf32", "f32"), peaks))[sys.argv[1]])
PY
}

field() { # log pattern: the first number after pattern in the peer's log
  sed -n -E "s/.*$2 ([0-9.e+-]+).*/\\1/p" "$1" | head -1
}

versions=$("$python" -c 'import torch, transformers; print(f"PyTorch {torch.__version__}, transformers {transformers.__version__}")')
where=$([ "$device" = cuda ] && "$python" -c 'import torch; print(torch.cuda.get_device_name(0))' || echo "CPU, OMP_NUM_THREADS=$OMP_NUM_THREADS")
echo "$versions; GPT-2 $preset, data ${DATA:-synthetic $size}, $procs process(es) on $where"
rows=()
notes=()
cap=$([ "$device" = cuda ] && echo 100 || echo 50)
for precision in $precisions; do
  for micro in $micros; do
    global=${GLOBAL:-$((micro * procs))}
    [ $((global % (micro * procs))) = 0 ] || die "GLOBAL=$global is not a multiple of MICRO $micro x PROCS $procs"
    accum=$((global / (micro * procs)))
    tag="$precision-m$micro"
    dump="$out/dump-$tag"
    ours "ours-$tag" "$precision" "$micro" "$global" "$dump"
    figures=$(ours_figures "$out/ours-$tag" "$global")
    read -r o_rate o_ms o_steps o_data o_compute o_coll o_update <<<"$figures"
    steps=${PEER_STEPS:-$((o_steps < cap ? o_steps : cap))}
    peer "peer-$tag" "$dump" "$steps" "$precision"
    log="$out/peer-$tag.log"
    p_rate=$(field "$log" "peer samples\\/s")
    p_data=$(field "$log" "ms\\/step data")
    p_fwd=$(field "$log" " forward")
    p_bwd=$(field "$log" " backward")
    p_opt=$(field "$log" " optimizer")
    flops=$(field "$log" "flops\\/sample")
    tokens=$(field "$log" "tokens\\/sample")
    pk=$(peak "$precision")
    [ -n "$p_rate" ] && [ -n "$flops" ] || die "no figures in $log"
    derived=$("$python" - "$global" "$p_rate" "$p_fwd" "$p_bwd" "$o_rate" "$flops" "${pk:-0}" "$procs" <<'PY'
import sys
g, rate, fwd, bwd, o_rate, flops, peak, procs = map(float, sys.argv[1:])
mfu = lambda r: f"{100 * r * flops / (peak * 1e12 * procs):.1f}%" if peak > 0 else "-"
print(f"{1000 * g / rate:.3f} {fwd + bwd:.3f} {mfu(o_rate)} {mfu(rate)}")
PY
)
    read -r p_ms p_fb o_mfu p_mfu <<<"$derived"
    plan="$micro x $accum x $procs"
    rows+=("| ours | $precision | $plan | $o_rate | $o_ms | $o_data | $o_compute | $o_coll | $o_update | $o_mfu |")
    rows+=("| PyTorch + transformers | $precision | $plan | $p_rate | $p_ms | $p_data | $p_fb ($p_fwd + $p_bwd) | in backward | $p_opt | $p_mfu |")
    notes+=("$tag: $(grep -a -o 'peer parity.*' "$log" | head -1)")
    synced=$(field "$log" "peer samples\\/s synchronised per phase")
    notes+=("$tag: ours $o_steps steady steps, the peer $steps${synced:+ (and $synced samples/s over its phase steps)}; $tokens real tokens and $flops FLOPs per sample${pk:+; peak $pk TFLOP/s}")
  done
done
echo
echo "| side | precision | micro x accum x procs | samples/s | ms/step | data | forward + backward | all-reduce | optimizer (with clipping) | MFU |"
echo "|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
how="the timed steps"
[ "$device" = cuda ] && how="PHASE_STEPS more steps (default 10), synchronised at each phase boundary"
echo "samples/s and ms/step: the training steps after the first $warmup of each side (ours: the step"
echo "records of its metrics.jsonl; evaluation and checkpoints are outside them). Phases, ms per step:"
echo "ours, the summary's time per step after its 3 warm-up steps (rank 0; on a GPU host time, GPU"
echo "work counted in the phase that waits for it: a one-rank run makes no collective, its"
echo "\"all-reduce\" is the wait for backward's kernels); the peer, $how, its DDP all-reduce"
echo "overlapping backward. MFU: FLOPs per sample from the real tokens (see this script's header)."
printf '%s\n' "${notes[@]}"
