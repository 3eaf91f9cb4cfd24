"""Helper of scripts/bench/vs_recbole.sh: runs one RecBole model on exported atomic files, reads
one of our runs' metrics.jsonl, and prints the side-by-side table.

Owns: RecBole's run configuration for the comparison and the run-time patches that let RecBole
1.2.1 run on torch 2.11 / numpy 2 / pandas of today. Must not: install anything (the shell
script does), change the split (export-split wrote it), or train our models.

  vs_recbole.py recbole --model BPR --data-path DIR --dataset NAME --workdir DIR --out FILE.json
  vs_recbole.py ours --run-dir runs/NAME --model bpr --wall-s S --out FILE.json
  vs_recbole.py table FILE.json...

Run-time patches (applied by `patch_for_current_stack` before RecBole is imported; the files
in site-packages stay as pip installed them):
  1. numpy 2 removed `np.float_`, `np.complex_`, `np.unicode_` (and long before, `np.float`,
     `np.int`, `np.bool`, `np.object`, `np.long`, `np.str`, `np.complex`, `np.unicode`).
     RecBole's `Config.compatibility_settings` assigns `np.float = np.float_` etc. (an
     AttributeError on numpy 2), and its evaluator uses `np.float` / `np.bool`, data loading
     `np.float`, layers `np.long`: the old names are put back as the numpy types they meant.
  2. torch >= 2.6 made `torch.load(weights_only=True)` the default; RecBole's checkpoint (saved
     by RecBole itself in the work directory) holds its config object and numpy values, which
     the weights-only unpickler refuses when the trainer loads the best model for the test:
     `torch.load` defaults to `weights_only=False` again (only files this run wrote are loaded).
  3. scipy >= 1.11 made `dok_matrix` no longer a dict subclass and dropped its private
     `_update(dict)`; LightGCN (and NGCF, GCMC, NCL, SpectralCF, ...) builds its adjacency
     matrix with `A._update(data_dict)` (AttributeError): `_update` is put back, filling the
     matrix's key dictionary as before (an older scipy cannot be pinned: none is built for
     numpy 2).
  4. pandas >= 3 (copy-on-write, string dtype by default) is not patched but avoided: the shell
     script installs `pandas<3` (under pandas 3, RecBole's `feat[field].fillna(..., inplace=True)`
     silently does nothing).
  5. RecBole's Pop counts wrongly for a popularity baseline; `--exact-pop` adds a second Pop row
     that counts each positive once (see `exact_pop_counts`). RecBole's own Pop row is unpatched.
Not installed, and not needed on this path: ray and plotly (RecBole's hyper-parameter search,
`recbole.quick_start`, which this helper does not import).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

STARTED = time.monotonic()
METRICS = ["recall@10", "recall@20", "ndcg@10", "ndcg@20"]


def patch_for_current_stack() -> None:
    """The run-time patches 1 to 3 of the module doc comment."""
    import numpy as np

    aliases = {
        "float_": np.float64,
        "complex_": np.complex128,
        "unicode_": np.str_,
        "float": float,
        "int": int,
        "bool": bool,
        "object": object,
        "long": np.int64,
        "str": str,
        "complex": complex,
        "unicode": np.str_,
    }
    for name, value in aliases.items():
        if name not in np.__dict__:
            setattr(np, name, value)

    import torch

    original_load = torch.load

    def load(*args, **kwargs):
        kwargs.setdefault("weights_only", False)
        return original_load(*args, **kwargs)

    torch.load = load

    import scipy.sparse as sp

    if not hasattr(sp.dok_matrix, "_update"):

        def _update(self, data):
            entries = {(int(i), int(j)): v for (i, j), v in data.items()}
            if isinstance(getattr(self, "_dict", None), dict):
                self._dict.update(entries)  # scipy >= 1.12 keeps the entries here
            else:
                for key, v in entries.items():
                    self[key] = v

        sp.dok_matrix._update = _update


def recbole_config(args: argparse.Namespace) -> dict:
    """The comparison's RecBole settings: the exported files as they are, full ranking."""
    return {
        "data_path": args.data_path,
        # The atomic files are NAME.train.inter, NAME.valid.inter, NAME.test.inter; with this
        # key RecBole takes them as the split and skips its own filtering and splitting.
        "benchmark_filename": ["train", "valid", "test"],
        "load_col": {"inter": ["user_id", "item_id"]},
        # No filtering (with benchmark files RecBole skips it anyway) and no rating threshold:
        # export-split already kept ratings >= min_rating, as our loader does.
        "user_inter_num_interval": "[0,inf)",
        "item_inter_num_interval": "[0,inf)",
        # Full ranking, grouped by user; `split` is ignored with benchmark files (RecBole
        # splits by the files' sizes), `order` too.
        "eval_args": {"split": {"RS": [0.8, 0.1, 0.1]}, "group_by": "user", "order": "RO", "mode": "full"},
        "metrics": ["Recall", "NDCG"],
        "topk": [10, 20],
        "valid_metric": "NDCG@10",
        "metric_decimal_place": 6,
        "embedding_size": 64,
        "learning_rate": 1e-3,
        "train_batch_size": 2048,
        "eval_batch_size": 4096,
        "epochs": 300,
        "stopping_step": 10,
        "eval_step": 1,
        # One uniform negative per positive, never an item of the user's train set (RecBole's
        # default, spelled out).
        "train_neg_sample_args": {"distribution": "uniform", "sample_num": 1, "alpha": 1.0, "dynamic": False, "candidate_num": 0},
        "seed": args.seed,
        "reproducibility": True,
        "device": "cpu",
        "use_gpu": False,
        "show_progress": False,
        "checkpoint_dir": os.path.join(args.workdir, "saved"),
        "log_wandb": False,
    }


def exact_pop_counts(label_field: str) -> None:
    """RecBole's Pop counts `item_cnt[items] = item_cnt[items] + 1` per training batch: an item
    that occurs many times in a batch counts once (indexed assignment), and the batch holds the
    sampled negatives too (Pop is pointwise). Its ranking is then nearly "in how many batches
    the item occurred, as a positive or a negative", with many ties at the top. With
    `--exact-pop` (model row "RecBole Pop (exact counts)") each positive counts once, which is
    the popularity every other baseline means, ours included."""
    import torch
    from recbole.model.general_recommender.pop import Pop

    def calculate_loss(self, interaction):
        item = interaction[self.ITEM_ID]
        if label_field in interaction.interaction:
            item = item[interaction[label_field] > 0]
        self.item_cnt.index_add_(0, item, torch.ones_like(item).unsqueeze(1))
        self.max_cnt = torch.max(self.item_cnt, dim=0)[0]
        return torch.nn.Parameter(torch.zeros(1)).to(self.device)

    Pop.calculate_loss = calculate_loss


def run_recbole(args: argparse.Namespace) -> None:
    patch_for_current_stack()
    os.makedirs(args.workdir, exist_ok=True)
    # RecBole writes log/ and log_tensorboard/ into the working directory.
    os.chdir(args.workdir)
    import recbole
    from recbole.config import Config
    from recbole.data import create_dataset, data_preparation
    from recbole.utils import get_model, get_trainer, init_logger, init_seed

    # RecBole's Config also reads `--key=value` from sys.argv: give it none of ours.
    sys.argv = sys.argv[:1]
    settings = recbole_config(args)
    if args.model in ("EASE", "MultiVAE", "ItemKNN"):
        # Trained against every item at once (or not trained): no negatives to sample, each
        # with its own defaults (EASE reg_weight 250, ItemKNN k 100, MultiVAE's annealing).
        settings["train_neg_sample_args"] = None
    config = Config(model=args.model, dataset=args.dataset, config_dict=settings)
    init_seed(config["seed"], config["reproducibility"])
    init_logger(config)
    if args.exact_pop:
        exact_pop_counts(config["LABEL_FIELD"])
    dataset = create_dataset(config)
    train_data, valid_data, test_data = data_preparation(config, dataset)
    init_seed(config["seed"] + config["local_rank"], config["reproducibility"])
    model = get_model(config["model"])(config, train_data._dataset).to(config["device"])
    trainer = get_trainer(config["MODEL_TYPE"], config["model"])(config, model)
    record_best_epoch(trainer)
    _, best_valid = trainer.fit(train_data, valid_data, saved=True, show_progress=False)
    test = trainer.evaluate(test_data, load_best_model=True, show_progress=False)
    result = {
        "model": f"RecBole {args.model}" + (" (exact counts)" if args.exact_pop else ""),
        "recbole_version": recbole.__version__,
        "users": int(dataset.user_num - 1),
        "items": int(dataset.item_num - 1),
        "interactions": int(len(dataset.inter_feat)),
        "test_users": int(len(test_data.uid_list)),
        "best_epoch": trainer.best_epoch,
        "valid": {k.lower(): float(v) for k, v in best_valid.items()},
        "test": {k.lower(): float(v) for k, v in test.items()},
        # From this process's start: imports, data loading, training, test.
        "wall_s": time.monotonic() - STARTED,
    }
    write_json(args.out, result)
    print(json.dumps(result))


def record_best_epoch(trainer) -> None:
    """RecBole saves a checkpoint exactly when validation improves; wrapping that call records
    the epoch of the best validation (RecBole keeps only the score)."""
    save = trainer._save_checkpoint
    trainer.best_epoch = -1

    def save_and_record(epoch, *a, **kw):
        trainer.best_epoch = epoch
        return save(epoch, *a, **kw)

    trainer._save_checkpoint = save_and_record


def ours(args: argparse.Namespace) -> None:
    """Our run's test metrics (best validation model) from its metrics.jsonl."""
    path = os.path.join(args.run_dir, "metrics.jsonl")
    test, valid_best = None, None
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if rec.get("kind") == "eval" and rec.get("split") == "test":
                test = rec
            if rec.get("kind") == "eval" and rec.get("split") == "valid":
                if valid_best is None or rec.get("ndcg@10", -1) > valid_best.get("ndcg@10", -1):
                    valid_best = rec
    if test is None:
        sys.exit(f"vs_recbole.py: {path}: no test evaluation (did the run finish?)")
    result = {
        "model": f"ours {args.model}",
        "test_users": test.get("users"),
        "test": {m: test.get(m) for m in METRICS},
        "valid": {m: (valid_best or {}).get(m) for m in METRICS},
        "best_epoch": (valid_best or {}).get("epoch"),
    }
    result["wall_s"] = args.wall_s
    write_json(args.out, result)
    if args.pop_out:
        write_json(args.pop_out, our_baseline(args.log, "pop", "ours pop"))
    if args.ease_out:
        write_json(args.ease_out, our_baseline(args.log, "ease", "ours EASE"))


def our_baseline(log: str, tag: str, name: str) -> dict:
    """A baseline's test metrics from our run's summary (`pop test users=N recall@10=...`,
    `ease test ...`): every run evaluates them, but metrics.jsonl keeps only popularity's
    validation."""
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = re.search(rf"\b{tag} test\s+users=(\d+)\s+(.*)$", line)
            if m:
                pairs = dict(kv.split("=", 1) for kv in m.group(2).split() if "=" in kv)
                return {
                    "model": name,
                    "test_users": int(m.group(1)),
                    "test": {k: float(pairs[k]) for k in METRICS if k in pairs},
                    # Evaluated inside the bpr run: no time of its own.
                    "wall_s": None,
                }
    sys.exit(f"vs_recbole.py: {log}: no '{tag} test' summary line")


def table(args: argparse.Namespace) -> None:
    """One row per model: the mean of its runs (one per seed), their count, and the range of
    NDCG@10 over them."""
    runs = [json.load(open(p, encoding="utf-8")) for p in args.files]
    models = list(dict.fromkeys(r["model"] for r in runs))
    head = ["model", "Recall@10", "Recall@20", "NDCG@10", "NDCG@20", "NDCG@10 range", "seeds",
            "wall s", "test users"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    mean_ndcg = {}
    for model in models:
        rows = [r for r in runs if r["model"] == model]
        mean = {m: sum(r["test"][m] for r in rows) / len(rows) for m in METRICS}
        mean_ndcg[model] = mean["ndcg@10"]
        ndcgs = [r["test"]["ndcg@10"] for r in rows]
        walls = [r.get("wall_s") for r in rows if r.get("wall_s") is not None]
        walls = [w for w in walls if not math.isnan(w)]
        cells = [model] + [fmt(mean[m]) for m in METRICS]
        cells += [f"{min(ndcgs):.4f}-{max(ndcgs):.4f}", str(len(rows)),
                  f"{sum(walls) / len(walls):.0f}" if walls else "-",
                  str(rows[0].get("test_users", "?"))]
        print("| " + " | ".join(cells) + " |")
    for ours_name, theirs in [("ours bpr", "RecBole BPR"), ("ours gpt2rec", "RecBole LightGCN"),
                              ("ours gpt2rec", "RecBole BPR"), ("ours gpt2rec", "RecBole EASE"),
                              ("ours gpt2rec", "RecBole MultiVAE"), ("ours EASE", "RecBole EASE")]:
        a, b = mean_ndcg.get(ours_name), mean_ndcg.get(theirs)
        if a is None or b is None:
            continue
        print(f"NDCG@10: {ours_name} {a:.4f} vs {theirs} {b:.4f} ({(a / b - 1) * 100:+.1f}%)")


def fmt(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recbole")
    r.add_argument("--model", required=True)
    r.add_argument("--data-path", required=True)
    r.add_argument("--dataset", required=True)
    r.add_argument("--workdir", required=True)
    r.add_argument("--seed", type=int, default=2020)
    r.add_argument("--exact-pop", action="store_true", help="Pop counting each positive once")
    r.add_argument("--out", required=True)
    o = sub.add_parser("ours")
    o.add_argument("--run-dir", required=True)
    o.add_argument("--model", required=True)
    o.add_argument("--wall-s", type=float, required=True)
    o.add_argument("--out", required=True)
    o.add_argument("--log", help="the run's log, for --pop-out")
    o.add_argument("--pop-out", help="also write our popularity baseline's test metrics here")
    o.add_argument("--ease-out", help="also write our EASE baseline's test metrics here")
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    args = p.parse_args()
    {"recbole": run_recbole, "ours": ours, "table": table}[args.cmd](args)


if __name__ == "__main__":
    main()
