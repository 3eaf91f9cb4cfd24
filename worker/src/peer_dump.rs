//! `GPTREC_DUMP_PEER=DIR`, a benchmark hook: before the first training step, rank 0 writes what
//! the PyTorch peer of the dynamic GPT-2 training step (`scripts/bench/gpt2_peer.py`, which
//! `scripts/bench/vs_pytorch_gpt2.sh` runs) needs to compute what this run computes; then
//! training goes on unchanged (nothing here draws from torch's generator, and the one variable
//! change, the probe below, is undone before training starts). Into DIR:
//! - `weights.safetensors`: every variable of the model as training starts, under our names:
//!   `user_id.weight`, `item_id.weight`, `user_text_proj.*`, `item_text_proj.*`, and GPT-2's
//!   under `gpt2.`, followed by Hugging Face `GPT2Model`'s own names (`gpt2.h.0.attn.c_attn.weight`);
//! - `tables.safetensors`: the token tables as the model holds them (`user_ids`, `user_mask`,
//!   `item_ids`, `item_mask`, [rows, longest text]) and the training pairs (`pairs`,
//!   [interactions, 2]: user, positive item, in the order the sampler indexes them);
//! - `batch.safetensors`: one micro-batch (`users`, `pos`, `neg`: rank 0's first of epoch 0,
//!   its negatives drawn as training draws them) and the probe's text projections
//!   (`probe.user_text_proj.weight`, ...);
//! - `meta.json`, written last: sizes, hyper-parameters, which variables train, and our loss on
//!   the micro-batch with dropout off, with the variables as they start (`loss`) and with the
//!   text projections set to the probe's values (`loss_probe`). The projections start at zero,
//!   so the first loss alone says nothing about GPT-2: the probe's makes the text count.
//!
//! It must not change what the run computes; it refuses models the peer does not mirror.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use common::config::{ModelKind, ScorerKind, TextMode};
use common::train_plan::TrainPlan;
use recommender::model::gpt2::Tokenizer;
use recommender::{RecData, RecTask};
use runtime::sampler::DistributedSampler;
use serde_json::json;
use tch::{nn, Device, Kind, Tensor};

/// The variable naming the dump's directory.
pub const ENV: &str = "GPTREC_DUMP_PEER";

/// The variables the probe sets, and the scale of the values it gives them.
const PROBE: [(&str, f64); 4] = [
    ("user_text_proj.weight", 0.5),
    ("user_text_proj.bias", 0.1),
    ("item_text_proj.weight", 0.5),
    ("item_text_proj.bias", 0.1),
];

/// AdamW's betas and epsilon, as the trainer builds its optimizer.
const ADAMW_BETAS: [f64; 2] = [0.9, 0.999];
const ADAMW_EPS: f64 = 1e-8;

/// The micro-batch of the dump: users, positive items, negative items (dense ids).
type Batch = (Vec<i64>, Vec<i64>, Vec<i64>);

/// When `GPTREC_DUMP_PEER` names a directory and this is rank 0: the dump (see the module's
/// documentation) of `task`, whose variables are in `vs`, trained on `data` by `plan`. Called
/// once, after the model is built and the micro batch known, before the trainer starts.
pub fn from_env(
    plan: &TrainPlan,
    data: &RecData,
    vs: &nn::VarStore,
    task: &RecTask,
    rank: u32,
) -> Result<()> {
    let Some(dir) = std::env::var_os(ENV).filter(|v| !v.is_empty()) else {
        return Ok(());
    };
    if rank != 0 {
        return Ok(());
    }
    let dir = PathBuf::from(dir);
    let (loss, probe) = dump(&dir, plan, data, vs, task).with_context(|| {
        format!(
            "{ENV}={}: writing what the PyTorch peer needs",
            dir.display()
        )
    })?;
    tracing::info!(
        "{ENV}: the model, token tables and a micro-batch written to {} for the PyTorch peer; our loss on it, dropout off: {loss:.9} (with the probe's text projections: {probe:.9})",
        dir.display()
    );
    Ok(())
}

/// Writes the dump into `dir`; our losses (initial, probe).
fn dump(
    dir: &Path,
    plan: &TrainPlan,
    data: &RecData,
    vs: &nn::VarStore,
    task: &RecTask,
) -> Result<(f64, f64)> {
    let m = &plan.config.model;
    if m.kind != ModelKind::Gpt2rec
        || m.text_mode != TextMode::Dynamic
        || m.scorer != ScorerKind::Dot
    {
        bail!(
            "the peer mirrors model.kind = \"gpt2rec\" with model.text_mode = \"dynamic\" and model.scorer = \"dot\"; this run has {:?}, {:?}, {:?}",
            m.kind,
            m.text_mode,
            m.scorer
        );
    }
    if plan.config.train.loss != common::config::LossKind::Bpr {
        bail!("the peer mirrors train.loss = \"bpr\"; this run has train.loss = \"softmax\"");
    }
    let tower = match m.user_tower {
        common::config::UserTower::Id => None,
        common::config::UserTower::History => Some("history"),
        common::config::UserTower::Both => Some("both"),
    };
    if let Some(tower) = tower {
        bail!("the peer mirrors model.user_tower = \"id\" (a user is their ID row and text); this run has model.user_tower = \"{tower}\"");
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // meta.json marks a whole dump: one from an earlier run goes first.
    let meta_path = dir.join("meta.json");
    match std::fs::remove_file(&meta_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing {}", meta_path.display()))
        }
        _ => {}
    }
    let vars = vs.variables();
    let mut weights: Vec<(String, Tensor)> = vars
        .iter()
        .map(|(name, var)| (name.clone(), var.shallow_clone()))
        .collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    write(&dir.join("weights.safetensors"), weights)?;
    write(
        &dir.join("tables.safetensors"),
        tables(data, m.max_text_tokens, task)?,
    )?;

    let (users, pos, neg) = first_batch(plan, data, task)?;
    let loss = task.eval_loss(&users, &pos, &neg)?;
    let (probe, loss_probe) = with_probe(&vars, || task.eval_loss(&users, &pos, &neg))?;
    let mut batch = vec![
        ("users".to_string(), Tensor::from_slice(&users)),
        ("pos".to_string(), Tensor::from_slice(&pos)),
        ("neg".to_string(), Tensor::from_slice(&neg)),
    ];
    batch.extend(probe);
    write(&dir.join("batch.safetensors"), batch)?;

    let meta = meta(plan, data, vs, loss, loss_probe)?;
    let text = serde_json::to_string_pretty(&meta).context("meta.json")?;
    std::fs::write(&meta_path, text + "\n")
        .with_context(|| format!("writing {}", meta_path.display()))?;
    Ok((loss, loss_probe))
}

/// `tensors` (any device) as a safetensors file at `path`.
fn write(path: &Path, tensors: Vec<(String, Tensor)>) -> Result<()> {
    let on_cpu = tensors
        .into_iter()
        .map(|(name, t)| {
            Ok((
                name,
                t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?,
            ))
        })
        .collect::<Result<Vec<_>, tch::TchError>>()?;
    Tensor::write_safetensors(&on_cpu, path).with_context(|| format!("writing {}", path.display()))
}

/// The token tables, tokenised as the model does (`max_len` tokens at most, right-padded to the
/// longest), and the training pairs in the task's order.
fn tables(data: &RecData, max_len: usize, task: &RecTask) -> Result<Vec<(String, Tensor)>> {
    let tok = Tokenizer::new()?;
    let (user_ids, user_mask) = tok.encode_batch(&data.user_texts, max_len);
    let (item_ids, item_mask) = tok.encode_batch(&data.item_texts, max_len);
    let pairs = training_pairs(data);
    if pairs.len() != task.train_len() {
        bail!(
            "{} training pairs here, {} in the task",
            pairs.len(),
            task.train_len()
        );
    }
    let flat: Vec<i64> = pairs.iter().flat_map(|&(u, i)| [u, i]).collect();
    Ok(vec![
        ("user_ids".into(), user_ids),
        ("user_mask".into(), user_mask),
        ("item_ids".into(), item_ids),
        ("item_mask".into(), item_mask),
        ("pairs".into(), Tensor::from_slice(&flat).f_view([-1, 2])?),
    ])
}

/// (user, positive item) of every training interaction, as `RecTask` indexes them.
fn training_pairs(data: &RecData) -> Vec<(i64, i64)> {
    let train = &data.dataset.train;
    train
        .iter()
        .enumerate()
        .flat_map(|(u, items)| items.iter().map(move |&i| (u as i64, i64::from(i))))
        .collect()
}

/// Rank 0's first micro-batch of epoch 0, with a negative per pair drawn as training draws them
/// (uniform among the warm items outside the user's training items), from a generator of our
/// own: torch's stays as training expects it.
fn first_batch(plan: &TrainPlan, data: &RecData, task: &RecTask) -> Result<Batch> {
    let (world, micro) = (plan.batch.world_size as usize, plan.batch.micro as usize);
    let sampler = DistributedSampler::new(task.train_len(), world, 0, plan.config.run.seed)?;
    let indices = sampler
        .batches(0, micro, 0, true)
        .into_iter()
        .next()
        .with_context(|| {
            format!(
                "no whole micro-batch of {micro} among {} training pairs",
                task.train_len()
            )
        })?;
    let pairs = training_pairs(data);
    let ds = &data.dataset;
    let mut state = runtime::rng::mix(plan.config.run.seed ^ runtime::rng::GOLDEN);
    let (mut users, mut pos, mut neg) = (Vec::new(), Vec::new(), Vec::new());
    for i in indices {
        let (u, p) = *pairs.get(i).context("a sampler index past the pairs")?;
        let owned = ds.train.get(u as usize).map_or(&[][..], Vec::as_slice);
        let n = recommender::data::sample_negative(owned, ds.n_warm_items, &mut state)
            .map_or(p, i64::from);
        users.push(u);
        pos.push(p);
        neg.push(n);
    }
    Ok((users, pos, neg))
}

/// `f`'s result with the text projections set to the probe's values (undone before returning,
/// whatever `f` gave), and those values under `probe.<name>`.
fn with_probe<T>(
    vars: &HashMap<String, Tensor>,
    f: impl FnOnce() -> Result<T, tch::TchError>,
) -> Result<(Vec<(String, Tensor)>, T)> {
    let _guard = tch::no_grad_guard();
    let mut saved = Vec::new();
    let mut values = Vec::new();
    for (name, scale) in PROBE {
        let var = vars
            .get(name)
            .with_context(|| format!("the model has no variable {name}"))?;
        values.push((format!("probe.{name}"), probe_values(var, scale)?));
        saved.push((var.shallow_clone(), var.f_detach_copy()?));
    }
    let result =
        copy_all(saved.iter().zip(&values).map(|((var, _), (_, v))| (var, v))).and_then(|()| f());
    copy_all(saved.iter().map(|(var, old)| (var, old)))?;
    Ok((values, result?))
}

/// Copies each value into its variable.
fn copy_all<'a>(
    pairs: impl Iterator<Item = (&'a Tensor, &'a Tensor)>,
) -> Result<(), tch::TchError> {
    pairs
        .into_iter()
        .try_for_each(|(var, value)| var.shallow_clone().f_copy_(value))
}

/// Fixed values of `var`'s shape and device, `scale * sin(0.7 k + 0.3)` for its k-th entry:
/// no draw from any generator, and entries of both signs with no two rows alike.
fn probe_values(var: &Tensor, scale: f64) -> Result<Tensor, tch::TchError> {
    Tensor::f_arange(var.numel() as i64, (Kind::Float, var.device()))?
        .f_mul_scalar(0.7)?
        .f_add_scalar(0.3)?
        .f_sin()?
        .f_mul_scalar(scale)?
        .f_view(var.size().as_slice())
}

/// `meta.json`: what the peer needs besides the tensors.
fn meta(
    plan: &TrainPlan,
    data: &RecData,
    vs: &nn::VarStore,
    loss: f64,
    loss_probe: f64,
) -> Result<serde_json::Value> {
    let (config, b, ds) = (&plan.config, plan.batch, &data.dataset);
    let (m, t) = (&config.model, &config.train);
    let (g, _) = recommender::text::gpt2_source(config)?;
    let cuda = vs.device().is_cuda();
    let mut trainable: Vec<String> = vs
        .variables()
        .into_iter()
        .filter(|(_, v)| v.requires_grad())
        .map(|(name, _)| name)
        .collect();
    trainable.sort();
    Ok(json!({
        "format": 1,
        "n_users": ds.n_users, "n_items": ds.n_items,
        "n_warm_users": ds.n_warm_users, "n_warm_items": ds.n_warm_items,
        "dim": m.embedding_dim, "l2": m.l2, "text_l2": m.text_l2,
        "max_text_tokens": m.max_text_tokens,
        "gpt2_label": m.gpt2_label(),
        "gpt2": {
            "n_layer": g.n_layer, "n_head": g.n_head, "n_embd": g.n_embd,
            "n_positions": g.n_positions, "vocab_size": g.vocab_size,
            "layer_norm_epsilon": g.layer_norm_epsilon, "embd_pdrop": g.embd_pdrop,
            "attn_pdrop": g.attn_pdrop, "resid_pdrop": g.resid_pdrop,
        },
        "activation_checkpointing": m.activation_checkpointing,
        "train": {
            "lr": t.lr, "weight_decay": t.weight_decay, "max_grad_norm": t.max_grad_norm,
            "betas": ADAMW_BETAS, "eps": ADAMW_EPS,
            // As the run applies them: bf16 on either device, TF32 on CUDA only.
            "bf16": t.bf16, "tf32": t.tf32 && cuda,
        },
        "batch": {"global": b.global, "micro": b.micro, "grad_accum": b.grad_accum, "world": b.world_size},
        "device": if cuda { "cuda" } else { "cpu" },
        "seed": config.run.seed,
        "trainable": trainable,
        "loss": loss,
        "loss_probe": loss_probe,
    }))
}
