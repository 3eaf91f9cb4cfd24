#!/usr/bin/env bash
# bf16 autocast on the CPU (`train.bf16 = true`) against f32, and against PyTorch's own CPU
# autocast (`torch.autocast("cpu", torch.bfloat16)`, what `accelerate launch --cpu
# --mixed_precision bf16` gives a script), in one run:
#   1. GPT-2 small's training step in dynamic mode (`gpt2-step-bench`: random weights, every
#      weight trains, dropout on, micro user texts + 2 x micro item texts of 32 tokens, mean
#      pooling, BPR; seconds per step after the first, peak RSS), and the same step written with
#      transformers' GPT2Model (SDPA attention), both on one thread;
#   2. configs/ml-100k.toml (the softmax, the history pool, the item-item matrix) trained by
#      `launch` on 2 processes, cold shares 0, the split of seed 42: steady ms per step by phase
#      and the test NDCG@10 of each precision.
# The CPU must compute bf16 natively (AVX512-BF16 or AMX) for autocast to pay; the first line
# says whether it does.
#
# Usage: scripts/bench/cpu_bf16.sh      (about 6 minutes here; MICRO, default 8; EPOCHS, default 20)
set -eu
cd "$(dirname "$0")/../.."
. scripts/setup.sh >&2 # its lines on stderr, the figures on stdout
cargo build --release --workspace >/dev/null 2>&1 || cargo build --release --workspace
bash scripts/data/ml100k.sh >/dev/null # once: MovieLens-100k into the cache (offline)
micro="${MICRO:-8}"
epochs="${EPOCHS:-20}"
out="${BENCH_OUT:-scripts/bench/out/cpu_bf16-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
python="${PYTHON:-python}" # the venv scripts/setup.sh made and activated
if grep -qwE 'avx512_bf16|amx_bf16|bf16' /proc/cpuinfo 2>/dev/null; then native=yes; else native=no; fi
echo "native bf16 (avx512_bf16, amx_bf16 or Arm's bf16 in /proc/cpuinfo): $native; $(nproc) cores"

# 1. GPT-2 small's step, ours and transformers', f32 and bf16, each in its own process.
for bf16 in "" --bf16; do
  OMP_NUM_THREADS=1 target/release/gpt2-step-bench --preset gpt2 --micro "$micro" --tokens 32 \
    --steps 3 $bf16 >>"$out/ours.jsonl"
done
for precision in f32 bf16; do
  PRECISION=$precision MICRO=$micro OMP_NUM_THREADS=1 "$python" - >>"$out/peer.jsonl" <<'PY'
import json, os, resource, time
import torch
from transformers import GPT2Config, GPT2Model
torch.set_num_threads(1)
torch.manual_seed(0)
micro, tokens, bf16 = int(os.environ["MICRO"]), 32, os.environ["PRECISION"] == "bf16"
model = GPT2Model(GPT2Config(attn_implementation="sdpa")).train()
users = torch.randint(50_000, (micro, tokens))
items = torch.randint(50_000, (2 * micro, tokens))
seconds = []
for _ in range(3):
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        u = model(users).last_hidden_state.mean(1)
        i = model(items).last_hidden_state.mean(1)
        p, n = i[:micro], i[micro:]
        diff = (u * p).float().sum(-1) - (u * n).float().sum(-1)
        loss = -(diff.sigmoid() + 1e-10).log().mean()
    loss.backward()
    model.zero_grad(set_to_none=False)
    seconds.append(time.perf_counter() - t0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"bf16": bf16, "seconds_per_step": sum(seconds[1:]) / 2, "peak_rss_mib": peak}))
PY
done

# 2. The ML-100k config, f32 and bf16.
for bf16 in false true; do
  log="$out/ml100k-$bf16.log"
  if ! target/release/launch --num-processes 2 configs/ml-100k.toml \
    --set run.output_dir="\"$out/runs\"" --set run.name="\"bf16-$bf16\"" \
    --set checkpoint.resume=\"never\" --set data.cold_items=0 --set data.cold_users=0 \
    --set data.split_seed=42 --set train.epochs="$epochs" --set train.bf16="$bf16" >"$log" 2>&1; then
    echo "cpu_bf16.sh: the ML-100k run with train.bf16=$bf16 failed; its last lines ($log):" >&2
    tail -3 "$log" >&2
    exit 1
  fi
done

python3 - "$out" "$micro" <<'PY'
import json, os, sys
out, micro = sys.argv[1], sys.argv[2]
rows = lambda f: [json.loads(l) for l in open(os.path.join(out, f))]
ours = {r["bf16"]: r for r in rows("ours.jsonl")}
peer = {r["bf16"]: r for r in rows("peer.jsonl")}
print(f"GPT-2 small training step, micro {micro} (+ 2 x {micro} item texts) x 32 tokens, one thread")
print("| side | precision | s/step | speed-up over f32 | peak RSS MiB |")
print("|---|---|---|---|---|")
for name, side in (("ours", ours), ("PyTorch + transformers", peer)):
    for bf16 in (False, True):
        r = side[bf16]
        print("| %s | %s | %.2f | %.2fx | %.0f |" % (name, "bf16" if bf16 else "f32", r["seconds_per_step"],
              side[False]["seconds_per_step"] / r["seconds_per_step"], r["peak_rss_mib"]))
print()
print("configs/ml-100k.toml, 2 processes, cold shares 0, split of seed 42")
print("| precision | steady ms/step | compute | update | samples/s | test NDCG@10 | test Recall@10 |")
print("|---|---|---|---|---|---|---|")
for bf16 in ("false", "true"):
    recs = rows(os.path.join("runs", f"bf16-{bf16}", "metrics.jsonl"))
    summary = [r for r in recs if r["kind"] == "summary"][-1]
    test = [r for r in recs if r.get("split") == "test" and r["kind"] == "eval"][-1]
    # Too few steps for a steady state (a small EPOCHS): every step's mean instead.
    steps = summary["steady_time_per_step_ms"] or summary["time_per_step_ms"][0]
    rate = summary["steady_samples_per_s"] or summary["samples_per_s"]
    print("| %s | %.1f | %.1f | %.1f | %.0f | %.4f | %.4f |" % ("bf16" if bf16 == "true" else "f32", sum(steps.values()),
          steps["compute"], steps["update"], rate, test["ndcg@10"], test["recall@10"]))
PY
