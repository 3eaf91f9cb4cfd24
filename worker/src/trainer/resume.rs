//! Resuming: which checkpoint a run continues from (rank 0 decides; everyone is told), checks
//! that it belongs to this model, data order and batch, loading tensors by name, the best
//! model, and making the run directory hold only what this run owns.

use std::path::{Path, PathBuf};

use runtime::checkpoint::NamedTensors;

use common::train_plan::TrainPlan;
use serde::{Deserialize, Serialize};
use tch::Tensor;
use tracing::{info, warn};

use runtime::checkpoint::{self, TrainState};

use super::{broadcast_json, TrainError, Trainer};

/// What early stopping remembers between evaluations, and across a resume (in the
/// checkpoint's `state.json`, next to the position).
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(super) struct EvalProgress {
    /// The best validation result so far (its model is in `<run dir>/best/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) best: Option<BestRecord>,
    /// Evaluations since the best one (early stopping counts these).
    #[serde(default)]
    pub(super) evals_since_best: u32,
    /// Training ended early (patience ran out): a resume goes straight to the test evaluation.
    #[serde(default)]
    pub(super) stopped_early: bool,
}

impl EvalProgress {
    /// As a checkpoint stores it.
    pub(super) fn to_state(&self) -> serde_json::Map<String, serde_json::Value> {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        }
    }

    /// From a checkpoint's state.
    pub(super) fn from_state(state: &TrainState) -> Result<EvalProgress, TrainError> {
        serde_json::from_value(serde_json::Value::Object(state.trainer.clone()))
            .map_err(|e| TrainError::Resume(format!("the checkpoint's early-stopping state: {e}")))
    }
}

/// The best validation evaluation of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BestRecord {
    /// Epochs done and optimizer steps taken when it was evaluated.
    pub epoch: u64,
    pub step: u64,
    /// The metric that chose it (`eval.metric`) and its value.
    pub metric: String,
    pub value: f64,
    /// All its validation metrics.
    pub valid: recommender::eval::Metrics,
}

/// How a checkpoint's fingerprint compares with the task's. A fingerprint is `MODEL+DATA` (what
/// the tensors mean, and what they were trained on) or, from a task that has no data part or
/// from before tasks added it, `MODEL` alone: that one is compared on the model part only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fingerprint {
    Same,
    OtherModel,
    OtherData,
}

impl Fingerprint {
    /// Compares the fingerprint a checkpoint was `stored` with against the task's `now`.
    pub(crate) fn compare(stored: &str, now: &str) -> Fingerprint {
        let (stored_model, stored_data) = split_fingerprint(stored);
        let (model, data) = split_fingerprint(now);
        match (stored_data, data) {
            _ if stored_model != model => Fingerprint::OtherModel,
            (Some(a), Some(b)) if a != b => Fingerprint::OtherData,
            _ => Fingerprint::Same,
        }
    }
}

fn split_fingerprint(fingerprint: &str) -> (&str, Option<&str>) {
    match fingerprint.split_once('+') {
        Some((model, data)) => (model, Some(data)),
        None => (fingerprint, None),
    }
}

/// What trained on other data means, for messages.
const OTHER_DATA: &str = "trained on other data or another split (run.seed, data.min_rating, data.cold_items, data.cold_users or the data files differ)";

/// Copies the model saved in `<run dir>/best/` into `params`; with `model_hash`, refuses a
/// best model written for another model or trained on other data (the trainer's own is its
/// run's by construction).
pub fn load_best(
    params: &[(String, Tensor)],
    dir: &Path,
    model_hash: Option<&str>,
) -> Result<(), TrainError> {
    let mut skipped = Vec::new();
    let Some((path, state)) = checkpoint::find_latest(dir, &mut skipped)? else {
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
    if let Some(expected) = model_hash {
        let why = match Fingerprint::compare(&state.model_hash, expected) {
            Fingerprint::Same => None,
            Fingerprint::OtherModel => Some("written for another model"),
            Fingerprint::OtherData => Some(OTHER_DATA),
        };
        if let Some(why) = why {
            return Err(TrainError::Resume(format!(
                "{}: {why} (fingerprint {} vs {expected})",
                path.display(),
                state.model_hash
            )));
        }
    }
    let (model, _, _) = checkpoint::load(&path)?;
    load_params(params, &model)
}

/// Rank 0's answer to "do we resume, and from where?", shared with every rank.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct ResumeDecision {
    pub(super) path: Option<String>,
    pub(super) state: Option<TrainState>,
    pub(super) error: Option<String>,
    /// The checkpoint is another run's: this run starts from its weights at step 0.
    #[serde(default)]
    pub(super) from_other_run: bool,
}

pub(super) fn resume_decision(
    plan: &TrainPlan,
    default_dir: &Path,
    model_hash: String,
    world: usize,
) -> ResumeDecision {
    let setting = plan.config.checkpoint.resume.trim();
    let (dir, explicit) = match setting {
        "never" => return ResumeDecision::default(),
        "auto" => (default_dir.to_path_buf(), false),
        path => (PathBuf::from(path), true),
    };
    if !explicit || is_within(&dir, default_dir) {
        return continue_decision(plan, &dir, explicit, model_hash, world);
    }
    // Another run's checkpoint. A run that already has one of its own (restarted after a
    // failure, or run again) continues it rather than starting over from the other run.
    let mut skipped = Vec::new();
    if let Ok(Some((own, _))) = checkpoint::find_latest(default_dir, &mut skipped) {
        info!(
            "checkpoint.resume = {setting:?} is another run's, but this run has a checkpoint of its own ({}): continuing this run",
            own.display()
        );
        return continue_decision(plan, default_dir, false, model_hash, world);
    }
    other_run_decision(&dir, &model_hash)
}

/// Whether `path` lies in `dir` (both resolved; `false` when either does not exist).
fn is_within(path: &Path, dir: &Path) -> bool {
    match (std::fs::canonicalize(path), std::fs::canonicalize(dir)) {
        (Ok(path), Ok(dir)) => path.starts_with(dir),
        _ => false,
    }
}

/// The checkpoint in `dir` (a checkpoint, or the newest of a `checkpoints` directory or of a
/// run directory's), if any.
fn find_checkpoint(
    dir: &Path,
    skipped: &mut Vec<String>,
) -> Result<Option<(PathBuf, TrainState)>, checkpoint::CheckpointError> {
    if dir.join("state.json").is_file() {
        checkpoint::verify(dir).map(|state| Some((dir.to_path_buf(), state)))
    } else if dir.join("checkpoints").is_dir() {
        checkpoint::find_latest(&dir.join("checkpoints"), skipped)
    } else {
        checkpoint::find_latest(dir, skipped)
    }
}

/// Starting this run from another run's checkpoint `dir` (fine-tuning): its weights must fit
/// this model; its data, batch, seed and world may differ, since this run starts at step 0.
fn other_run_decision(dir: &Path, model_hash: &str) -> ResumeDecision {
    let fail = |error: String| ResumeDecision {
        error: Some(error),
        ..Default::default()
    };
    let mut skipped = Vec::new();
    let found = find_checkpoint(dir, &mut skipped);
    for why in &skipped {
        warn!("skipping checkpoint: {why}");
    }
    match found {
        Err(e) => fail(e.to_string()),
        Ok(None) => fail(format!(
            "checkpoint.resume = {:?}: no complete checkpoint there",
            dir.display().to_string()
        )),
        Ok(Some((path, state))) => {
            if Fingerprint::compare(&state.model_hash, model_hash) == Fingerprint::OtherModel {
                return fail(format!(
                    "{} was written for a different model config (fingerprint {} vs {model_hash} now): a run can start from another run's weights only when the model is the same",
                    path.display(),
                    state.model_hash
                ));
            }
            ResumeDecision {
                path: Some(path.display().to_string()),
                state: Some(state),
                error: None,
                from_other_run: true,
            }
        }
    }
}

/// Continuing a run from its checkpoint in `dir` (`explicit`: named by `checkpoint.resume`, so
/// finding none there is an error): the model, data, batch and seed must be the run's.
fn continue_decision(
    plan: &TrainPlan,
    dir: &Path,
    explicit: bool,
    model_hash: String,
    world: usize,
) -> ResumeDecision {
    let (config, batch) = (&plan.config, plan.batch);
    let setting = config.checkpoint.resume.trim();
    let mut skipped = Vec::new();
    let found = find_checkpoint(dir, &mut skipped);
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
            let why = match Fingerprint::compare(&state.model_hash, &model_hash) {
                Fingerprint::Same => None,
                Fingerprint::OtherModel => Some("written for a different model config"),
                Fingerprint::OtherData => Some(OTHER_DATA),
            };
            if let Some(why) = why {
                return fail(format!(
                    "{} was {why} (fingerprint {} vs {} now); change the config back, or start a new run (another run.name or checkpoint.resume = \"never\")",
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
                from_other_run: false,
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
/// points `latest` at the checkpoint it resumed from (`resumed_from`), saves the best model
/// again from its checkpoint when `best/` lacks it ([`best_from_checkpoint`]), and cuts `metrics.jsonl` back to the records up to the start (whole lines only).
/// Returns the summary of the run that ended where this one starts, if there was one.
pub(super) fn own_the_run_dir(
    run_dir: &Path,
    start: &TrainState,
    resumed_from: Option<&Path>,
) -> Result<Option<serde_json::Value>, TrainError> {
    let resumed = resumed_from.is_some();
    let best_step = EvalProgress::from_state(start)?.best.map(|b| b.step);
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
    if let Some(best) = best_step {
        let resumed_at_best = resumed_from.filter(|_| best == start.step);
        best_from_checkpoint(run_dir, resumed_at_best, best)?;
    }
    let metrics = run_dir.join("metrics.jsonl");
    let (dropped, summary) = crate::run_dir::repair_metrics(&metrics, start.step)?;
    if dropped > 0 {
        info!(
            "metrics.jsonl: set aside {dropped} record(s) after step {}, of the test, the summary or incomplete (rewritten at the end)",
            start.step
        );
    }
    Ok(summary)
}

/// The best model is saved after its epoch's checkpoint, as a link to its model file: a run
/// that stopped before that save (or whose save failed) left `best/` without the best model
/// its state names (`step`). It is saved again from that checkpoint, the run's own or the one
/// resumed from (`resumed_at_best`, when that is of `step`), if one is still there and
/// complete; otherwise testing reports the best model missing, as before.
fn best_from_checkpoint(
    run_dir: &Path,
    resumed_at_best: Option<&Path>,
    step: u64,
) -> Result<(), TrainError> {
    let (best, name) = (run_dir.join("best"), checkpoint::step_dir_name(step));
    if best.join(&name).is_dir() {
        return Ok(());
    }
    let own = run_dir.join("checkpoints").join(&name);
    let Some(from) = [Some(own.as_path()), resumed_at_best]
        .into_iter()
        .flatten()
        .find(|from| checkpoint::verify(from).is_ok())
    else {
        return Ok(());
    };
    checkpoint::save_linked(&best, from, step, 1)?;
    warn!(
        "the best model (step {step}) was not in {}: saved again from {}",
        best.display(),
        from.display()
    );
    Ok(())
}

impl Trainer<'_> {
    /// Rank 0 finds, checks and loads the checkpoint, then tells everyone the outcome
    /// (including its failure, so nobody waits for a rank that gave up); the tensors travel by
    /// broadcast, so no shared file system is needed.
    pub(super) fn resume(&mut self) -> Result<(), TrainError> {
        // Rank 0 loads into whole parameters (ZeRO stage 3 keeps shards between steps).
        self.ddp.gather_params()?;
        let decision = if self.leader() {
            self.decide_resume()
        } else {
            ResumeDecision::default()
        };
        let (leader, ctx) = (self.leader(), self.ctx(0));
        let decision: ResumeDecision =
            broadcast_json(self.ddp.comm(), leader.then_some(&decision), ctx)?;
        if let Some(error) = decision.error {
            return Err(TrainError::Resume(error));
        }
        match (decision.path, decision.state) {
            (Some(path), Some(state)) if decision.from_other_run => {
                self.start_from_other_run(Path::new(&path), &state)
            }
            (Some(path), Some(state)) => self.continue_from(PathBuf::from(path), state),
            _ => Ok(()),
        }
    }

    /// Every rank takes rank 0's weights (and, with `checkpoint.load_optimizer`, its optimizer
    /// state) from another run's checkpoint; this run starts at step 0 with its own schedule,
    /// data order and early stopping.
    fn start_from_other_run(&mut self, path: &Path, state: &TrainState) -> Result<(), TrainError> {
        self.ddp.broadcast_params(0)?;
        let with_optimizer = self.setup.plan.config.checkpoint.load_optimizer;
        if with_optimizer {
            self.share_optimizer_state(0)?;
        }
        if self.leader() {
            info!(
                "starting from the weights of {} (step {}, epoch {} of its run) at step 0 of this run, with {}",
                path.display(),
                state.step,
                state.epoch,
                if with_optimizer {
                    "its optimizer state (checkpoint.load_optimizer = true)"
                } else {
                    "a fresh optimizer (checkpoint.load_optimizer = true takes its moments too)"
                }
            );
        }
        Ok(())
    }

    /// Every rank receives rank 0's optimizer state into tensors of the right shapes (whole
    /// ones, each rank keeping its shard, under ZeRO).
    fn share_optimizer_state(&mut self, step: u64) -> Result<(), TrainError> {
        let mut shaped = match self.loaded_optimizer.take() {
            // In the template's order (a checkpoint's tensors come sorted by name).
            Some(whole) if self.leader() => {
                let mut template = self.optimizer.state_template();
                for (name, t) in &mut template {
                    if let Some((_, value)) = whole.iter().find(|(n, _)| n == name) {
                        *t = value.shallow_clone();
                    }
                }
                template
            }
            _ if self.ddp.zero_stage() > 0 => self.optimizer.state_template(),
            _ => self.optimizer.state_tensors(),
        };
        let mut values: Vec<tch::Tensor> = shaped.iter().map(|(_, t)| t.shallow_clone()).collect();
        let ctx = self.ctx(step);
        self.ddp.comm().broadcast(&mut values, 0, ctx)?;
        for ((_, t), v) in shaped.iter_mut().zip(values) {
            *t = v;
        }
        self.optimizer
            .load_state_tensors(&shaped)
            .map_err(|e| TrainError::Resume(e.to_string()))
    }

    /// Rank 0's decision, with the checkpoint already loaded into its model and optimizer.
    pub(super) fn decide_resume(&mut self) -> ResumeDecision {
        let checkpoints = self.checkpoints();
        for line in crate::run_dir::clean_temporaries(&checkpoints) {
            info!("checkpoints: {line}");
        }
        let world = self.ddp.world_size();
        let mut decision =
            resume_decision(self.setup.plan, &checkpoints, self.task.model_hash(), world);
        // Another run's moments are taken only when asked for.
        let with_optimizer =
            !decision.from_other_run || self.setup.plan.config.checkpoint.load_optimizer;
        if let (Some(path), None) = (&decision.path, &decision.error) {
            let applied = checkpoint::load(Path::new(path))
                .map_err(|e| e.to_string())
                .and_then(|(model, optim, _)| {
                    let optim = if with_optimizer { &optim[..] } else { &[] };
                    self.load(&model, optim).map_err(|e| format!("{path}: {e}"))
                });
            if let Err(e) = applied {
                decision.error = Some(e);
            }
        }
        decision
    }

    /// Loads `model` into the variables and, unless it is empty, `optim` into the optimizer.
    pub(super) fn load(
        &mut self,
        model: &NamedTensors,
        optim: &[(String, Tensor)],
    ) -> Result<(), TrainError> {
        load_params(&self.ddp.named_variables(), model)?;
        if optim.is_empty() {
            return Ok(());
        }
        if self.ddp.zero_stage() > 0 {
            // This optimizer keeps only our shard: the whole goes to the others from here.
            self.loaded_optimizer = Some(
                optim
                    .iter()
                    .map(|(n, t)| (n.clone(), t.shallow_clone()))
                    .collect(),
            );
        }
        self.optimizer
            .load_state_tensors(optim)
            .map_err(|e| TrainError::Resume(e.to_string()))
    }

    /// Every rank takes rank 0's parameters and optimizer state and the checkpoint's position;
    /// the schedule spans the number of steps the config gives now.
    pub(super) fn continue_from(
        &mut self,
        path: PathBuf,
        state: TrainState,
    ) -> Result<(), TrainError> {
        self.ddp.broadcast_params(0)?;
        self.share_optimizer_state(state.step)?;
        // The schedule spans the run as configured now: more epochs lengthen it (a run
        // extended under its old length would train on at its final, often zero, rate).
        let total = self.total_steps;
        if self.leader() {
            self.announce_resume(&path, &state, total);
        }
        let tracker = &self.setup.memory;
        tracker.update(|f| f.last_checkpoint = Some(path.display().to_string()));
        tracker.set_step(state.step);
        self.start = TrainState {
            schedule_steps: Some(total),
            ..state
        };
        self.resumed_from = Some(path);
        Ok(())
    }

    pub(super) fn announce_resume(&self, path: &Path, state: &TrainState, total: u64) {
        let world = self.ddp.world_size();
        let stopped_early = EvalProgress::from_state(state).is_ok_and(|e| e.stopped_early);
        if state.epoch >= self.epochs || stopped_early {
            info!(
                "resuming from {} (step {}): the run is complete ({} of {} epoch(s){}), nothing left to train; the best model is evaluated again (raise train.epochs to train on; a new run.name or checkpoint.resume = \"never\" starts over)",
                path.display(),
                state.step,
                state.epoch,
                self.epochs,
                if stopped_early { ", stopped early" } else { "" },
            );
            return;
        }
        info!(
            "resuming from {} (epoch {}, step {}, written by {} rank(s); now {world})",
            path.display(),
            state.epoch + 1,
            state.step,
            state.world_size
        );
        if let Some(old) = state.schedule_steps.filter(|old| *old != total) {
            let mut before = self.schedule;
            before.total_steps = old;
            let mut after = self.schedule;
            after.total_steps = total;
            warn!(
                "the learning-rate schedule now spans {total} steps instead of {old} (train.epochs or the data changed): at step {} the rate goes from {:.3e} to {:.3e}",
                state.step,
                before.lr_at(state.step),
                after.lr_at(state.step)
            );
        }
        if state.world_size != world as u64 {
            warn!(
                "resuming with world {world} from a checkpoint of world {}: the run continues with the same global batch and learning-rate schedule ({total} steps), but not bit-exactly (each rank's share of the data and the order of the sums change)",
                state.world_size
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64) -> TrainState {
        TrainState {
            epoch: 1,
            step,
            samples_in_epoch: 0,
            seed: 1,
            world_size: 2,
            global_batch: 8,
            model_hash: "m".into(),
            rng: String::new(),
            files: Default::default(),
            trainer: Default::default(),
            schedule_steps: None,
        }
    }

    /// The best model missing from `best/` is saved again from the run's checkpoint of its step
    /// (the newest checkpoint or an older one), and only from a complete one.
    #[test]
    fn a_missing_best_model_is_saved_again_from_its_complete_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let model = vec![("w".to_string(), Tensor::from_slice(&[3.0f32]))];
        for step in [100, 200] {
            checkpoint::save(&run.join("checkpoints"), &model, &model, &state(step), 3).unwrap();
        }
        best_from_checkpoint(run, None, 100).unwrap();
        let (loaded, optimizer, saved) = checkpoint::load(&run.join("best/step-000100")).unwrap();
        assert_eq!((saved.step, loaded.len(), optimizer.len()), (100, 1, 0));
        // Already there: left alone. A damaged checkpoint is not a source.
        best_from_checkpoint(run, None, 100).unwrap();
        std::fs::write(run.join("checkpoints/step-000200/model.safetensors"), b"x").unwrap();
        best_from_checkpoint(run, None, 200).unwrap();
        assert!(!run.join("best/step-000200").exists());
    }

    /// A data part that differs is told apart from a model that differs; a checkpoint from
    /// before fingerprints had a data part is compared on the model alone.
    #[test]
    fn fingerprints_compare_model_and_data_parts() {
        use Fingerprint::*;
        assert_eq!(Fingerprint::compare("m1+d1", "m1+d1"), Same);
        assert_eq!(Fingerprint::compare("m1+d1", "m1+d2"), OtherData);
        assert_eq!(Fingerprint::compare("m1+d1", "m2+d1"), OtherModel);
        assert_eq!(Fingerprint::compare("m1", "m1+d2"), Same);
        assert_eq!(Fingerprint::compare("m1", "m2+d2"), OtherModel);
        assert_eq!(Fingerprint::compare("abc", "abc"), Same);
    }
}
