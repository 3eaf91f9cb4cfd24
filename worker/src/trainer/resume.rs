//! Resuming: which checkpoint a run continues from (rank 0 decides; everyone is told), checks
//! that it belongs to this model, data order and batch, loading tensors by name, the best
//! model, and making the run directory hold only what this run owns.

use std::path::{Path, PathBuf};

use common::batch::BatchPlan;
use common::config::Config;
use serde::{Deserialize, Serialize};
use tch::Tensor;
use tracing::{info, warn};

use crate::checkpoint::{self, TrainState};

use super::TrainError;

/// What early stopping remembers between evaluations (and across a resume).
#[derive(Debug, Default)]
pub(super) struct EvalProgress {
    pub(super) best: Option<crate::checkpoint::BestRecord>,
    pub(super) evals_since_best: u32,
    pub(super) stopped_early: bool,
}

/// Copies the model saved in `<run dir>/best/` into `params`.
pub(super) fn load_best(params: &[(String, Tensor)], dir: &Path) -> Result<(), TrainError> {
    let mut skipped = Vec::new();
    let Some((path, _)) = checkpoint::find_latest(dir, &mut skipped)? else {
        return Err(TrainError::Resume(format!(
            "{}: no complete best model{}",
            dir.display(),
            if skipped.is_empty() {
                String::new()
            } else {
                format!(" ({})", skipped.join("; "))
            }
        )));
    };
    let (model, _, _) = checkpoint::load(&path)?;
    load_params(params, &model)
}

/// Rank 0's answer to "do we resume, and from where?", shared with every rank.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct ResumeDecision {
    pub(super) path: Option<String>,
    pub(super) state: Option<TrainState>,
    pub(super) error: Option<String>,
}

pub(super) fn resume_decision(
    config: &Config,
    default_dir: &Path,
    model_hash: String,
    batch: BatchPlan,
    world: usize,
) -> ResumeDecision {
    let setting = config.checkpoint.resume.trim();
    let (dir, explicit) = match setting {
        "never" => return ResumeDecision::default(),
        "auto" => (default_dir.to_path_buf(), false),
        path => (PathBuf::from(path), true),
    };
    let mut skipped = Vec::new();
    let found = if dir.join("state.json").is_file() {
        checkpoint::verify(&dir).map(|state| Some((dir.clone(), state)))
    } else {
        checkpoint::find_latest(&dir, &mut skipped)
    };
    for why in &skipped {
        warn!("skipping checkpoint: {why}");
    }
    let fail = |error: String| ResumeDecision {
        error: Some(error),
        ..Default::default()
    };
    match found {
        Err(e) => fail(e.to_string()),
        Ok(None) if explicit => fail(format!(
            "checkpoint.resume = {setting:?}: no complete checkpoint there"
        )),
        Ok(None) => {
            if !skipped.is_empty() {
                warn!(
                    "no usable checkpoint in {} ({} unusable, listed above): starting from step 0",
                    dir.display(),
                    skipped.len()
                );
            }
            ResumeDecision::default()
        }
        Ok(Some((path, state))) => {
            if state.model_hash != model_hash {
                return fail(format!(
                    "{} was written for a different model config (fingerprint {} vs {} now); change [model] back, or start a new run (another run.name or checkpoint.resume = \"never\")",
                    path.display(),
                    state.model_hash,
                    model_hash
                ));
            }
            if state.global_batch != batch.global {
                return fail(format!(
                    "{} was trained with global batch {}, this run has {} ({}); resuming would change the training — set batch.global = {}",
                    path.display(),
                    state.global_batch,
                    batch.global,
                    batch.derivation(),
                    state.global_batch
                ));
            }
            if state.seed != config.run.seed {
                return fail(format!(
                    "{} was trained with run.seed = {}, this run has {}; the data order would change — set run.seed = {}",
                    path.display(),
                    state.seed,
                    config.run.seed,
                    state.seed
                ));
            }
            if config.train.scale_lr_with_world && state.world_size != world as u64 {
                return fail(format!(
                    "{} was written by {} rank(s), this run has {world}, and train.scale_lr_with_world = true would change the learning rate; resume with {} rank(s) or turn the scaling off",
                    path.display(),
                    state.world_size,
                    state.world_size
                ));
            }
            ResumeDecision {
                path: Some(path.display().to_string()),
                state: Some(state),
                error: None,
            }
        }
    }
}

/// Copies checkpoint tensors into the model's variables, by name.
pub(super) fn load_params(
    params: &[(String, Tensor)],
    saved: &[(String, Tensor)],
) -> Result<(), TrainError> {
    let _guard = tch::no_grad_guard();
    for (name, param) in params {
        let Some((_, value)) = saved.iter().find(|(n, _)| n == name) else {
            return Err(TrainError::Resume(format!(
                "the checkpoint has no tensor {name:?}"
            )));
        };
        if value.size() != param.size() {
            return Err(TrainError::Resume(format!(
                "tensor {name:?} has shape {:?} in the checkpoint but {:?} in the model",
                value.size(),
                param.size()
            )));
        }
        param.shallow_clone().f_copy_(value)?;
    }
    Ok(())
}

/// Describes how the run's random numbers are made (recorded in `state.json`).
pub(super) const RNG_SCHEME: &str = "torch generator reseeded before every optimizer step from (run.seed, step, rank); sampler order from (run.seed, epoch)";

/// Rank 0, once the start is known: moves aside what this run does not own (checkpoints above
/// its start, a best model its state does not name, an earlier run's metrics on a fresh start),
/// points `latest` at the checkpoint it resumed from, and cuts `metrics.jsonl` back to the
/// records up to the start (whole lines only).
pub(super) fn own_the_run_dir(
    run_dir: &Path,
    start: &TrainState,
    resumed: bool,
) -> Result<(), TrainError> {
    let best_step = start.best.as_ref().map(|b| b.step);
    if let Some((to, moved)) = crate::run_dir::set_aside(run_dir, start.step, best_step)? {
        warn!(
            "moved {} to {}: {} (nothing was deleted)",
            moved.join(", "),
            to.display(),
            if resumed {
                format!(
                    "written after step {}, which this run resumes from",
                    start.step
                )
            } else {
                "left by an earlier run; this one starts from step 0".to_string()
            }
        );
    }
    if resumed {
        crate::run_dir::point_latest(&run_dir.join("checkpoints"), start.step)?;
    }
    let dropped = crate::run_dir::repair_metrics(&run_dir.join("metrics.jsonl"), start.step)?;
    if dropped > 0 {
        info!(
            "metrics.jsonl: dropped {dropped} record(s) after step {} or incomplete",
            start.step
        );
    }
    Ok(())
}
