#!/usr/bin/env bash
# The memory estimate against what runs really use, on the CPU (peak RSS, the kernel's
# high-water mark). Every run writes <run>/memory.json: the estimate term by term and what
# rank 0 measured at each stage (after start-up, after loading the data, after building the
# model, the peak). This script runs a set of configs and prints, per run, the error of each
# part that can be measured on its own:
#   runtime  RSS after start-up (libtorch, threads, the collective)  vs "runtime (libtorch)"
#   build    peak after the model is built - runtime                 vs data + tokenizer +
#            parameters + text features / token tables + the build phase
#   train    peak - peak after build                                 vs gradients + optimizer +
#            training, checkpoint and evaluation phases
#   total    peak RSS                                                vs "estimated peak"
# and for dynamic GPT-2 the activations' slope (MiB per sample of micro batch) from runs that
# differ only in the micro batch, without and with activation checkpointing
# (model.activation_checkpointing), and what checkpointing saves and costs at each micro batch
# (peak RSS, estimate, samples/s).
#
# Usage: scripts/bench/memory.sh            (about 5 minutes here)
# On a GPU machine the same runs report device memory (NVML) in memory.json's
# measured.peak_device_mib; the table below then compares that with the GPU estimate.
set -eu
cd "$(dirname "$0")/../.."
. scripts/bench/lib.sh

run_case() { # name procs sets...
  local name=$1 procs=$2
  shift 2
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  if ! "$launch" --num-processes "$procs" --master-port 0 configs/default.toml \
      "${bpr_id[@]}" \
      --set run.output_dir=\""$out"\" --set run.name=\""$name"\" \
      --set checkpoint.resume=\"never\" --set eval.patience=0 --set train.epochs=1 \
      "${sets[@]}" >"$out/$name.log" 2>&1; then
    echo "$name failed: see $out/$name.log" >&2
    tail -5 "$out/$name.log" >&2
    return 1
  fi
}

run_case default-p2 2
run_case default-p1 1
run_case bpr-full 1 model.kind=\"bpr\" data.synthetic=\"full\"
run_case cached-full 1 data.synthetic=\"full\"
run_case cached-gpt2 1 model.preset=\"gpt2\"
for m in 32 64 128; do
  run_case dynamic-m$m 1 model.text_mode=\"dynamic\" data.synthetic=\"tiny\" batch.global=128 batch.micro=$m
  run_case dynamic-ckpt-m$m 1 model.text_mode=\"dynamic\" data.synthetic=\"tiny\" batch.global=128 batch.micro=$m \
    model.activation_checkpointing=true
done

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
names = ["default-p2", "default-p1", "bpr-full", "cached-full", "cached-gpt2", "dynamic-m32", "dynamic-m64",
         "dynamic-m128", "dynamic-ckpt-m32", "dynamic-ckpt-m64", "dynamic-ckpt-m128"]
def load(n):
    return json.load(open(os.path.join(out, n, "memory.json")))
def err(est, got):
    return "%+.0f%%" % ((est / got - 1) * 100) if got > 0 else "-"
print("| run | plan | part | estimate MiB | measured MiB | error |")
print("|---|---|---|---|---|---|")
for n in names:
    d = load(n)
    m = d["measured"]
    t = {x["name"]: x for x in d["estimate"]["terms"]}
    def est(pred):
        return sum(x["mib"] for x in t.values() if pred(x))
    peak = max(m["peak_rss_mib"])
    runtime = m["runtime_rss_mib"]
    build_meas = m["after_model_peak_mib"] - runtime
    build_est = est(lambda x: x["phase"] in ("always", "build") and x["name"] not in
                    ("runtime (libtorch)", "gradients", "optimizer (AdamW)"))
    train_meas = peak - m["after_model_peak_mib"]
    train_est = est(lambda x: x["phase"] in ("training", "checkpoint", "eval")
                    or x["name"] in ("gradients", "optimizer (AdamW)"))
    p = d["plan"]
    plan = "micro %d x accum %d x world %d" % (p["micro"], p["grad_accum"], p["world"])
    rows = [("runtime", t["runtime (libtorch)"]["mib"], runtime),
            ("build", build_est, build_meas),
            ("train", train_est, train_meas),
            ("total", d["estimate"]["peak_mib"], peak)]
    for part, e, g in rows:
        print("| %s | %s | %s | %.1f | %.1f | %s |" % (n, plan, part, e, g, err(e, g)))
def speed(n):
    # Mean samples/s of the step records after the first (start-up and warm-up).
    steps = [json.loads(l) for l in open(os.path.join(out, n, "metrics.jsonl"))]
    rates = [r["samples_per_s"] for r in steps if r.get("kind") == "step"][1:]
    return sum(rates) / len(rates) if rates else float("nan")
print()
acts = {}
for prefix, label in (("dynamic-m", "plain"), ("dynamic-ckpt-m", "checkpointed")):
    act = {}
    for mm in (32, 64, 128):
        d = load(prefix + str(mm))
        t = {x["name"]: x["mib"] for x in d["estimate"]["terms"]}
        act[mm] = (t["activations (GPT-2)"] + t["activations (IDs)"],
                   max(d["measured"]["peak_rss_mib"]), d["estimate"]["peak_mib"], speed(prefix + str(mm)))
    acts[label] = act
    se = (act[128][0] - act[32][0]) / 96
    sm = (act[128][1] - act[32][1]) / 96
    print("dynamic GPT-2 activations (%s), micro 32 -> 128: estimate %.3f MiB/sample, measured %.3f MiB/sample (%s)"
          % (label, se, sm, err(se, sm)))
print()
print("| micro | peak RSS plain MiB | peak RSS checkpointed MiB | saved (measured) | saved (estimate) | samples/s plain | samples/s checkpointed |")
print("|---|---|---|---|---|---|---|")
for mm in (32, 64, 128):
    p, c = acts["plain"][mm], acts["checkpointed"][mm]
    print("| %d | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f (%+.0f%%) |"
          % (mm, p[1], c[1], p[1] - c[1], p[2] - c[2], p[3], c[3], (c[3] / p[3] - 1) * 100))
PY
