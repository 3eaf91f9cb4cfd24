#!/usr/bin/env bash
# Quality against RecBole on the identical split, side by side: our bpr and gpt2rec (2 processes,
# configs/ml-100k.toml) and RecBole 1.2.1's Pop, BPR and LightGCN, all trained and tested on the
# same train/valid/test interactions of real MovieLens-100k, with the same metrics (full ranking,
# Recall/NDCG@10/20 on test with the best-validation model). Prints one table and two lines
# comparing NDCG@10 (our BPR vs RecBole's BPR, our gpt2rec vs RecBole's LightGCN).
#
#   bash scripts/bench/vs_recbole.sh
#
#   BENCH_OUT     where everything goes (default: runs/vs_recbole; wiped of earlier runs' results)
#   GPTREC_CACHE  the cache (default: ${XDG_CACHE_HOME:-$HOME/.cache}/gptrec): ML-100k, the torch
#                 2.11.0 venv of scripts/setup.sh, and RecBole's venv (recbole-1.2.1/, made once)
#   SEEDS         seeds of the models' initialisation and sampling, one run per model and seed
#                 (default "42"; e.g. "42 1 2" for a mean and a range); the split stays the one
#                 of SPLIT_SEED (ours through data.split_seed)
#   SPLIT_SEED    the seed of the split (default 42, the one configs/ml-100k.toml was tuned on)
#   MODELS        what to run (default: "ours-bpr ours-gpt2rec pop pop-exact bpr lightgcn"; also
#                 RecBole's "ease", "multivae", "itemknn"; ours-bpr's run also gives our popularity
#                 and EASE baselines; the table shows what $BENCH_OUT/results holds from this run)
#   SKIP_BUILD    1: use the binaries in target/release as they are (no cargo build)
#   OURS_SETS     space-separated KEY=VALUE settings added to our runs' (after cold start off and
#                 our bpr's own; e.g. OURS_SETS='train.bf16=true'; strings quoted as in --set)
#
# Steps: (a) ML-100k via scripts/data/ml100k.sh; (b) our split exported with `export-split` as
# RecBole atomic files NAME.{train,valid,test}.inter (cold start off: RecBole has none); (c)
# RecBole into its own venv that reuses the setup venv's torch through a .pth file (the setup
# venv is not touched); (d) RecBole's runs through scripts/bench/vs_recbole.py, which applies
# the run-time patches for today's numpy/torch/scipy (listed in its doc comment: numpy 2's
# removed aliases np.float/np.int/np.bool/np.long/np.float_/np.complex_/np.unicode_, torch>=2.6's
# torch.load weights_only=True default, scipy's removed dok_matrix._update that LightGCN uses;
# pandas 3 is avoided by installing pandas<3); (e) ours with `launch --num-processes 2`; (f)
# the table.
#
# Protocol, where the two agree (checked in RecBole 1.2.1's source): implicit feedback from
# ratings >= 3; a per-user 8:1:1 split (ours, handed to RecBole as its benchmark files, so
# RecBole filters and splits nothing); the item universe is every item with a positive
# interaction (export-split checks each is in some file, so RecBole's item set is ours); one
# uniform negative per positive, never one of the user's train items; validation every epoch
# on NDCG@10, at most 300 epochs (our gpt2rec: the config's 20), the best validation model tested; full ranking over all items, the user's train items excluded on
# valid and train+valid items on test; metrics averaged over the users with at least one test
# item (941 of 943 on ML-100k: a user with fewer than 10 positives has no valid/test share);
# NDCG's ideal DCG over min(|R(u)|, K) hits.
# Where they differ:
#   - ties: RecBole ranks with torch.topk (equal scores in whatever order topk returns them,
#     in practice by item index, i.e. by RecBole's remapped id); ours in a fixed pseudo-random
#     order of the items. It matters for Pop (many items share a training count), hardly for
#     the learned models.
#   - optimiser: RecBole Adam with a constant lr, no clipping, batch 2048; ours AdamW with a
#     cosine schedule (bpr: over 300 epochs, weight decay 0; gpt2rec: the config's, over 20
#     epochs, weight decay 0.3), global-norm clip 1.0, global batch 2304 over 2 processes (2304
#     divides on 1-8 processes).
#   - early stopping: RecBole after 10 validations without improvement (its stopping_step);
#     ours after 20 (configs/ml-100k.toml: tune.sh found a better validation NDCG with 20;
#     gpt2rec's 20 epochs end first). Every model is tested with its best validation epoch.
#   - regularisation and initialisation: RecBole's BPR has no L2 and xavier-normal init;
#     LightGCN keeps its default reg_weight 1e-5 and 2 layers; our bpr has no L2 either (and
#     RecBole's embedding 64 and lr 1e-3), our gpt2rec is configs/ml-100k.toml as it ships;
#     both with xavier-normal ID embeddings as RecBole's.
#   - threads: RecBole is one process on torch's default threads (2 here); ours is 2 processes
#     with OMP_NUM_THREADS=1 each (launch's default). The wall time is each run's whole process:
#     start, data, training, validation, test (RecBole's from the Python process's start, ours
#     launch's start to end); this 2-core machine is shared, so take it as rough.
#   - Pop: ours is the popularity baseline our trainer evaluates on test in every run (read
#     from the bpr run's summary: metrics.jsonl keeps only its validation). RecBole's Pop counts
#     an item once per training batch it occurs in, sampled negatives included, so its counts
#     saturate and tie; the row "RecBole Pop (exact counts)" counts each positive once and
#     matches ours but for ties (a check that both sides have the same split and metrics).
set -eu
cd "$(dirname "$0")/../.."
cache="${GPTREC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gptrec}"
out="${BENCH_OUT:-runs/vs_recbole}"
seeds="${SEEDS:-42}"
split_seed="${SPLIT_SEED:-42}"
models="${MODELS:-ours-bpr ours-gpt2rec pop pop-exact bpr lightgcn}"
config=configs/ml-100k.toml
name=ml100k
recbole_version=1.2.1
rvenv="$cache/recbole-$recbole_version"
helper=scripts/bench/vs_recbole.py
no_cold=(--set data.cold_items=0 --set data.cold_users=0 --set data.split_seed=$split_seed)

# (a) the data, (b) the build and the split.
bash scripts/data/ml100k.sh
. scripts/setup.sh >&2 # its lines (a first install of torch, about 4 GB) on stderr, the figures on stdout
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  cargo build --release -p gptrec-launcher -p gptrec-worker >/dev/null 2>&1 ||
    cargo build --release -p gptrec-launcher -p gptrec-worker
fi
mkdir -p "$out/results"
out=$(cd "$out" && pwd) # absolute: RecBole runs in its own working directory
rm -f "$out"/results/*.json
target/release/export-split "$config" "${no_cold[@]}" --out "$out/recbole-data/$name"

# (c) RecBole's venv, once: the same base Python as the setup venv (a .pth file only works
# for the same Python version), the setup venv's site-packages on its path (torch 2.11.0 is
# found there, not installed again), RecBole's dependencies, then RecBole and thop without
# theirs (their only dependency left is torch). Not installed: ray (RecBole pins <=2.6.3, a
# 57 MB wheel) and plotly, both for RecBole's hyper-parameter search only (recbole.quick_start),
# which the helper does not import. pandas<3: pandas 3's copy-on-write turns RecBole's
# `feat[field].fillna(..., inplace=True)` into a silent no-op.
install_recbole() {
  local tvenv="$cache/torch-2.11.0" site rsite
  echo "vs_recbole: installing RecBole $recbole_version into $rvenv (once)"
  rm -rf "$rvenv"
  "$tvenv/bin/python" -m venv "$rvenv"
  site=$("$tvenv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rsite=$("$rvenv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" >"$rsite/gptrec-torch-2.11.0.pth"
  "$rvenv/bin/python" -m pip install --quiet --progress-bar off \
    numpy scipy "pandas<3" tqdm colorlog==4.7.2 colorama==0.4.4 scikit-learn pyyaml \
    tensorboard tabulate texttable psutil
  "$rvenv/bin/python" -m pip install --quiet --progress-bar off --no-deps \
    "recbole==$recbole_version" "thop>=0.1.1.post2207130030"
  "$rvenv/bin/python" -c 'import torch, recbole; assert torch.__version__.startswith("2.11.0"), torch.__version__'
  touch "$rvenv/.gptrec-complete"
}
[ -f "$rvenv/.gptrec-complete" ] || install_recbole
echo "RecBole $("$rvenv/bin/python" -c 'import recbole; print(recbole.__version__)') with torch $("$rvenv/bin/python" -c 'import torch; print(torch.__version__)')"

# (d) RecBole: one model per process, its log in $out/recbole-TAG.log. `pop-exact` is RecBole's
# Pop with each positive counted once (RecBole's own counts an item once per batch, negatives
# included; see exact_pop_counts in the helper): it shows the split and the metrics agree, as
# it matches our popularity baseline but for ties.
recbole() { # TAG MODEL SEED [HELPER ARGS...]
  local tag=$1 model=$2 seed=$3
  shift 3
  echo "vs_recbole: RecBole $tag, seed $seed"
  local log="$out/recbole-$tag-s$seed.log"
  if ! "$rvenv/bin/python" "$helper" recbole --model "$model" "$@" \
    --data-path "$out/recbole-data" --dataset "$name" --workdir "$out/recbole-work" \
    --seed "$seed" --out "$out/results/recbole-$tag-s$seed.json" >"$log" 2>&1; then
    echo "RecBole $tag failed: see $log" >&2
    tail -5 "$log" >&2
    exit 1
  fi
}

# (e) ours: 2 processes, the config as it is but for cold start (off) and a fresh start. The bpr
# run's log also gives our popularity baseline's test line (evaluated in every run).
# Our bpr is BPR-MF as RecBole trains it (one negative per positive, the user's ID row,
# embedding 64, lr 1e-3, no L2, no weight decay, early stopping within 300 epochs), whatever
# the config ships for gpt2rec.
bpr_sets=(--set train.loss=\"bpr\" --set model.user_tower=\"id\" --set model.item_item=false --set model.embedding_dim=64
  --set train.lr=1e-3 --set model.l2=0 --set train.weight_decay=0.0 --set train.epochs=300)
ours() { # KIND SEED
  local kind=$1 seed=$2 run="ours-$1-s$2" start end sets=() kv
  echo "vs_recbole: ours $kind, seed $seed"
  [ "$kind" = bpr ] && sets=("${bpr_sets[@]}")
  for kv in ${OURS_SETS:-}; do sets+=(--set "$kv"); done
  start=$(date +%s.%N)
  if ! target/release/launch --num-processes 2 --master-port 0 "$config" "${no_cold[@]}" "${sets[@]}" \
    --set model.kind=\""$kind"\" --set run.output_dir=\""$out"\" --set run.name=\""$run"\" \
    --set checkpoint.resume=\"never\" --set run.seed="$seed" >"$out/$run.log" 2>&1; then
    echo "ours $kind failed: see $out/$run.log" >&2
    tail -5 "$out/$run.log" >&2
    exit 1
  fi
  end=$(date +%s.%N)
  local pop=()
  [ "$kind" = bpr ] && pop=(--log "$out/$run.log" --pop-out "$out/results/ours-pop-s$seed.json"
    --ease-out "$out/results/ours-ease-s$seed.json")
  python3 "$helper" ours --run-dir "$out/$run" --model "$kind" "${pop[@]}" \
    --wall-s "$(python3 -c "print($end - $start)")" --out "$out/results/$run.json"
}

for m in $models; do
  for s in $seeds; do
    case $m in
      pop) recbole Pop Pop "$s" ;;
      pop-exact) recbole Pop-exact Pop "$s" --exact-pop ;;
      bpr) recbole BPR BPR "$s" ;;
      lightgcn) recbole LightGCN LightGCN "$s" ;;
      ease) recbole EASE EASE "$s" ;;
      multivae) recbole MultiVAE MultiVAE "$s" ;;
      itemknn) recbole ItemKNN ItemKNN "$s" ;;
      ours-bpr) ours bpr "$s" ;;
      ours-gpt2rec) ours gpt2rec "$s" ;;
      *) echo "vs_recbole: unknown model $m (ours-bpr, ours-gpt2rec, pop, pop-exact, bpr, lightgcn, ease, multivae, itemknn)" >&2; exit 2 ;;
    esac
  done
done

# (f) the table, ours first.
results=()
for f in ours-pop ours-ease ours-bpr ours-gpt2rec recbole-Pop recbole-Pop-exact recbole-BPR \
  recbole-LightGCN recbole-EASE recbole-MultiVAE recbole-ItemKNN; do
  for s in $seeds; do
    [ -f "$out/results/$f-s$s.json" ] && results+=("$out/results/$f-s$s.json")
  done
done
echo
python3 "$helper" table "${results[@]}"
