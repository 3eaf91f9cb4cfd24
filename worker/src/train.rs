//! The training loop around the DDP engine: sampler → micro-batches → optimizer steps, the LR
//! schedule, logging (console and `metrics.jsonl`, rank 0), checkpoints at `every_n_steps` and
//! at the end of each epoch (rank 0 writes, the others wait at a barrier), resuming from a
//! checkpoint with the same or another world size, and — for tasks that can evaluate — the
//! validation evaluation every `eval.every_n_epochs`, the best model (`<run dir>/best/`), early
//! stopping on `eval.metric` with `eval.patience`, and the test evaluation of the best model at
//! the end. It works on any [`Task`] — a model plus a loss over a batch of sample indices — and
//! must not know what the model is.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::batch::BatchPlan;
use common::config::{Config, LrScheduleKind};
use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};
use tracing::{info, warn};

use crate::checkpoint::{self, BestRecord, NamedTensors, TrainState};
use crate::collective::{Collective, CollectiveError, OpContext};
use crate::ddp::{Ddp, DdpConfig, DdpError, MicroBatchLoss};
use crate::eval::Metrics;
use crate::memory::{self, Phase};
use crate::optim::{AdamW, LrSchedule, Schedule};
use crate::sampler::DistributedSampler;

/// What the engine trains: a model (its variables live in a `VarStore`) and a loss.
pub trait Task {
    /// Number of training samples (the sampler shards `0..train_len()`).
    fn train_len(&self) -> usize;
    /// Mean loss over the samples `indices` (one micro-batch), ready for backward.
    fn loss(&mut self, indices: &[usize]) -> Result<Tensor, tch::TchError>;
    /// Completes the backward pass after `loss(..).backward()` (activation checkpointing
    /// recomputes here). Default: nothing to do.
    fn finish_backward(&mut self) -> Result<(), tch::TchError> {
        Ok(())
    }
    /// A fingerprint of the model's configuration; a checkpoint of another model is refused.
    fn model_hash(&self) -> String;
    /// Metrics of the current model on `split`. Every rank calls it together (the task may
    /// split the work and reduce). `None` (the default): the task has nothing to evaluate.
    fn evaluate(
        &mut self,
        _split: Split,
        _comm: &mut dyn Collective,
        _ctx: OpContext,
    ) -> Result<Option<Metrics>, TrainError> {
        Ok(None)
    }
}

/// Which held-out part of the data an evaluation ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Valid,
    Test,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Valid => "valid",
            Split::Test => "test",
        }
    }
}

/// One evaluation as a line of `metrics.jsonl`: `{"kind":"eval","split":"valid","epoch":..,
/// "step":..,"users":..,"recall@10":..,...,"seconds":..}`.
pub fn eval_record(
    split: &str,
    epoch: u64,
    step: u64,
    metrics: &Metrics,
    seconds: f64,
) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    map.insert("kind".into(), "eval".into());
    map.insert("split".into(), split.into());
    map.insert("epoch".into(), epoch.into());
    map.insert("step".into(), step.into());
    map.insert("users".into(), metrics.users.into());
    for (i, k) in metrics.ks.iter().enumerate() {
        for (name, series) in [
            ("recall", &metrics.recall),
            ("ndcg", &metrics.ndcg),
            ("mrr", &metrics.mrr),
            ("hit", &metrics.hit),
            ("precision", &metrics.precision),
        ] {
            map.insert(format!("{name}@{k}"), series[i].into());
        }
    }
    map.insert("seconds".into(), seconds.into());
    serde_json::Value::Object(map)
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Ddp(#[from] DdpError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error(transparent)]
    RunDir(#[from] crate::run_dir::RunDirError),
    #[error("resume: {0}")]
    Resume(String),
    #[error("{0}")]
    Plan(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StepRecord {
    pub kind: String,
    pub epoch: u64,
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub samples_per_s: f64,
    /// At logged steps: the largest peak memory over the ranks so far (MiB; RSS on the CPU,
    /// device memory on GPUs) and the rank that has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_mem_mib: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_mem_rank: Option<u64>,
}

/// How the run ended.
#[derive(Debug, Clone)]
pub struct TrainReport {
    pub steps: u64,
    pub epochs_done: u64,
    pub last_loss: Option<f64>,
    /// Where training resumed from, if it did.
    pub resumed_from: Option<PathBuf>,
    /// The best validation evaluation (tasks that evaluate).
    pub best: Option<BestRecord>,
    /// Test metrics of the best model (of the last one when there was no validation).
    pub test: Option<Metrics>,
    /// Patience ran out before `train.epochs`.
    pub stopped_early: bool,
    /// Peak resident memory of each rank (bytes, from the kernel's high-water mark).
    pub peak_rss: Vec<u64>,
    /// Peak device memory of each rank (bytes, NVML) when training ran on GPUs.
    pub peak_device: Option<Vec<u64>>,
    /// Mean samples per second over the steps this run took (0 when it took none).
    pub samples_per_s: f64,
    /// Mean seconds per epoch over the epochs this run trained in full.
    pub seconds_per_epoch: Option<f64>,
}

/// Everything the loop needs besides the task.
pub struct TrainSetup<'a> {
    pub config: &'a Config,
    pub batch: BatchPlan,
    pub run_dir: PathBuf,
    /// Stop cleanly after this many epochs (a test hook that simulates an interrupted run;
    /// `GPTREC_STOP_AFTER_EPOCH`).
    pub stop_after_epoch: Option<u64>,
}

/// The `GPTREC_STOP_AFTER_EPOCH` test hook (see [`TrainSetup::stop_after_epoch`]).
pub fn stop_after_epoch_from_env() -> Option<u64> {
    std::env::var("GPTREC_STOP_AFTER_EPOCH")
        .ok()
        .and_then(|v| v.parse().ok())
}

/// Trains `task` whose trainable variables are in `vs`, data-parallel over `comm`.
pub fn train(
    task: &mut dyn Task,
    vs: &nn::VarStore,
    comm: Box<dyn Collective>,
    setup: &TrainSetup<'_>,
) -> Result<TrainReport, TrainError> {
    let config = setup.config;
    let batch = setup.batch;
    let timeout = Duration::from_secs(config.dist.timeout_s);
    let mut ddp = Ddp::new(
        comm,
        vs,
        DdpConfig {
            grad_accum: batch.grad_accum as usize,
            bucket_bytes: (config.dist.bucket_mb * 1024.0 * 1024.0) as usize,
            max_grad_norm: config.train.max_grad_norm,
            check_params_every: config.dist.check_params_every,
            timeout,
        },
    )?;
    let (rank, world) = (ddp.rank(), ddp.world_size());
    let ctx = |step| OpContext { step, timeout };
    // Waits on work only rank 0 does (writing a checkpoint) get more time than a collective.
    let slow_ctx = |step| OpContext {
        step,
        timeout: timeout.max(SLOW_WORK_TIMEOUT),
    };
    let leader = rank == 0;
    let device = vs.device();

    let sampler =
        DistributedSampler::new(task.train_len(), world, rank, config.run.seed, true, false)
            .map_err(|e| TrainError::Plan(e.to_string()))?;
    let per_rank_step = (batch.micro * batch.grad_accum) as usize;
    let steps_per_epoch = (sampler.num_samples() / per_rank_step) as u64;
    if steps_per_epoch == 0 {
        return Err(TrainError::Plan(format!(
            "{} training samples are fewer than one global batch of {} ({}); lower batch.global",
            task.train_len(),
            batch.global,
            batch.derivation()
        )));
    }
    let epochs = u64::from(config.train.epochs);
    let mut total_steps = epochs * steps_per_epoch;
    let peak_lr = if config.train.scale_lr_with_world {
        config.train.lr * world as f64
    } else {
        config.train.lr
    };
    let mut schedule = LrSchedule {
        peak_lr,
        warmup_steps: config.train.warmup_steps,
        total_steps,
        schedule: match config.train.lr_schedule {
            LrScheduleKind::Cosine => Schedule::Cosine,
            LrScheduleKind::Linear => Schedule::Linear,
            LrScheduleKind::Constant => Schedule::Constant,
        },
        min_lr: config.train.min_lr,
    };
    let mut optimizer = AdamW::new(ddp.params(), 0.9, 0.999, 1e-8, config.train.weight_decay);

    // Resume: rank 0 finds, checks and loads the checkpoint, then tells everyone the outcome
    // (including its failure, so nobody waits for a rank that gave up); the tensors travel by
    // broadcast, so no shared file system is needed.
    let checkpoints = setup.run_dir.join("checkpoints");
    let mut loaded: Option<(NamedTensors, NamedTensors)> = None;
    let decision = if leader {
        for line in crate::run_dir::clean_temporaries(&checkpoints) {
            info!("checkpoints: {line}");
        }
        let mut decision = resume_decision(config, &checkpoints, task.model_hash(), batch, world);
        if let (Some(path), None) = (&decision.path, &decision.error) {
            match checkpoint::load(Path::new(path)) {
                Ok((model, optim, _)) => loaded = Some((model, optim)),
                Err(e) => decision.error = Some(e.to_string()),
            }
        }
        if let Some((model, optim)) = &loaded {
            let applied = load_params(&ddp.named_variables(), model).and_then(|()| {
                optimizer
                    .load_state_tensors(optim)
                    .map_err(|e| TrainError::Resume(e.to_string()))
            });
            if let Err(e) = applied {
                decision.error = Some(format!(
                    "{}: {e}",
                    decision.path.clone().unwrap_or_default()
                ));
            }
        }
        decision
    } else {
        ResumeDecision::default()
    };
    let decision: ResumeDecision = broadcast_json(ddp.comm(), leader.then_some(&decision), ctx(0))?;
    if let Some(error) = decision.error {
        return Err(TrainError::Resume(error));
    }
    let mut start = TrainState {
        epoch: 0,
        step: 0,
        samples_in_epoch: 0,
        seed: config.run.seed,
        world_size: world as u64,
        global_batch: batch.global,
        model_hash: task.model_hash(),
        rng: RNG_SCHEME.to_string(),
        files: Default::default(),
        best: None,
        evals_since_best: 0,
        stopped_early: false,
        schedule_steps: Some(total_steps),
    };
    let resumed_from = decision.path.clone().map(PathBuf::from);
    if let (Some(path), Some(state)) = (&resumed_from, decision.state) {
        ddp.broadcast_params(0)?;
        // Everyone receives rank 0's optimizer state into tensors of the right shapes.
        let mut shaped: Vec<(String, Tensor)> = optimizer.state_tensors();
        let mut values: Vec<Tensor> = shaped.iter().map(|(_, t)| t.shallow_clone()).collect();
        ddp.comm().broadcast(&mut values, 0, ctx(state.step))?;
        for ((_, t), v) in shaped.iter_mut().zip(values) {
            *t = v;
        }
        optimizer
            .load_state_tensors(&shaped)
            .map_err(|e| TrainError::Resume(e.to_string()))?;
        drop(loaded.take());
        if leader {
            info!(
                "resuming from {} (epoch {}, step {}, written by {} rank(s); now {world})",
                path.display(),
                state.epoch + 1,
                state.step,
                state.world_size
            );
            if state.world_size != world as u64 {
                warn!(
                    "resuming with world {world} from a checkpoint of world {}: the run continues with the same global batch and learning-rate schedule ({} steps), but not bit-exactly (each rank's share of the data and the order of the sums change)",
                    state.world_size,
                    state.schedule_steps.unwrap_or(total_steps)
                );
            }
        }
        memory::update(|f| f.last_checkpoint = Some(path.display().to_string()));
        memory::set_step(state.step);
        // The schedule keeps the length it started with (older checkpoints: as computed now).
        total_steps = state.schedule_steps.unwrap_or(total_steps);
        schedule.total_steps = total_steps;
        start = TrainState {
            schedule_steps: Some(total_steps),
            ..state
        };
    }

    if leader {
        std::fs::create_dir_all(&setup.run_dir).map_err(|e| io(&setup.run_dir, e))?;
        let resolved = config
            .to_toml()
            .map_err(|e| TrainError::Plan(e.to_string()))?;
        let path = setup.run_dir.join("config.resolved.toml");
        std::fs::write(&path, resolved).map_err(|e| io(&path, e))?;
        own_the_run_dir(&setup.run_dir, &start, resumed_from.is_some())?;
    }

    // Early-stopping bookkeeping travels in every checkpoint.
    let mut progress = EvalProgress {
        best: start.best.clone(),
        evals_since_best: start.evals_since_best,
        stopped_early: start.stopped_early,
    };
    // A checkpoint at (epoch, step, samples consumed in that epoch).
    let checkpoint_at = |ddp: &mut Ddp,
                         optimizer: &AdamW,
                         progress: &EvalProgress,
                         epoch,
                         step,
                         samples_in_epoch| {
        let state = TrainState {
            epoch,
            step,
            samples_in_epoch,
            best: progress.best.clone(),
            evals_since_best: progress.evals_since_best,
            stopped_early: progress.stopped_early,
            ..start.clone()
        };
        save_checkpoint(
            ddp,
            &optimizer.state_tensors(),
            &checkpoints,
            state,
            config.checkpoint.keep as usize,
            slow_ctx(step),
        )?;
        let path = checkpoints.join(format!("step-{step:06}"));
        memory::update(|f| f.last_checkpoint = Some(path.display().to_string()));
        Ok::<(), TrainError>(())
    };
    let metric = config.eval.metric.trim().to_ascii_lowercase();
    let mut step = start.step;
    let mut last_loss = None;
    let mut epochs_done = start.epoch;
    let log_every = (steps_per_epoch / 10).max(1);
    let mut metrics = if leader {
        Some(crate::run_dir::MetricsLog::open(
            &setup.run_dir.join("metrics.jsonl"),
        )?)
    } else {
        None
    };
    let first_epoch = if progress.stopped_early {
        epochs
    } else {
        start.epoch
    };
    let train_start = Instant::now();
    let (mut steps_run, mut full_epochs, mut full_epoch_secs) = (0u64, 0u64, 0.0f64);
    let mut bar = (leader && progress_bar_wanted()).then(|| {
        let bar = indicatif::ProgressBar::new(total_steps);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg} [{bar:30}] step {pos}/{len} ETA {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_position(start.step);
        bar
    });
    for epoch in first_epoch..epochs {
        let skip = if epoch == start.epoch {
            (start.samples_in_epoch / world as u64) as usize
        } else {
            0
        };
        let batches = sampler.batches(epoch, batch.micro as usize, skip, true);
        let mut samples_in_epoch = skip as u64 * world as u64;
        let epoch_start = Instant::now();
        // Only whole windows: the rest does not fill a global batch.
        let windows = batches.len() / batch.grad_accum as usize;
        for (w, window) in batches
            .chunks(batch.grad_accum as usize)
            .take(windows)
            .enumerate()
        {
            let t0 = Instant::now();
            // Any randomness of the task (dropout, negative sampling) is a function of
            // (seed, step, rank): an interrupted and resumed run draws exactly the same numbers.
            tch::manual_seed(step_seed(config.run.seed, step, rank));
            let lr = schedule.lr_at(step);
            let stats = ddp.step(
                window,
                &mut TaskMicroBatches(&mut *task),
                &mut optimizer,
                lr,
                step,
            )?;
            step += 1;
            memory::set_step(step);
            steps_run += 1;
            samples_in_epoch += batch.global;
            last_loss = Some(stats.loss);
            let log_now = step % log_every == 0 || step == total_steps;
            // At logged steps every rank reports its peak; rank 0 logs the largest.
            let peak = if log_now {
                let all = gather_u64(ddp.comm(), memory::peak_bytes(device), ctx(step))?;
                all.iter()
                    .enumerate()
                    .max_by_key(|(_, &b)| b)
                    .map(|(r, &b)| (r as u64, b))
            } else {
                None
            };
            if let Some(file) = metrics.as_mut() {
                let record = StepRecord {
                    kind: "step".into(),
                    epoch: epoch + 1,
                    step,
                    loss: stats.loss,
                    lr,
                    grad_norm: stats.grad_norm,
                    samples_per_s: batch.global as f64 / t0.elapsed().as_secs_f64().max(1e-9),
                    peak_mem_mib: peak.map(|(_, b)| mib(b)),
                    peak_mem_rank: peak.map(|(r, _)| r),
                };
                file.append(&record)?;
                let elapsed = train_start.elapsed().as_secs_f64();
                let rate = (steps_run * batch.global) as f64 / elapsed.max(1e-9);
                if let Some(bar) = bar.as_mut() {
                    bar.set_position(step);
                    bar.set_message(format!(
                        "epoch {}/{epochs} loss {:.4} {rate:.0} samples/s",
                        epoch + 1,
                        stats.loss
                    ));
                } else if log_now {
                    let eta = elapsed / steps_run as f64 * total_steps.saturating_sub(step) as f64;
                    let (peak_rank, peak_bytes) = peak.unwrap_or_default();
                    info!(
                        "epoch {}/{epochs} step {step}/{total_steps} loss {:.6} lr {lr:.3e} grad_norm {:.4} {rate:.0} samples/s {:.1} ms/step, peak mem {:.0} MiB (rank {peak_rank}) ETA {}",
                        epoch + 1,
                        stats.loss,
                        stats.grad_norm,
                        elapsed * 1000.0 / steps_run as f64,
                        mib(peak_bytes),
                        format_duration(eta)
                    );
                }
            }
            let every = config.checkpoint.every_n_steps;
            // The last step of an epoch is saved as the end of the epoch, just below.
            if every > 0 && step % every == 0 && w + 1 < windows {
                checkpoint_at(
                    &mut ddp,
                    &optimizer,
                    &progress,
                    epoch,
                    step,
                    samples_in_epoch,
                )?;
            }
        }
        epochs_done = epoch + 1;
        let epoch_secs = epoch_start.elapsed().as_secs_f64();
        if skip == 0 {
            full_epochs += 1;
            full_epoch_secs += epoch_secs;
        }
        if leader {
            let line = format!("epoch {}/{epochs} done in {epoch_secs:.1} s", epoch + 1);
            match &bar {
                Some(bar) => bar.suspend(|| info!("{line}")),
                None => info!("{line}"),
            }
        }
        // Validation before the epoch's checkpoint, so the checkpoint knows the best so far.
        let every = u64::from(config.eval.every_n_epochs);
        if epochs_done % every == 0 || epochs_done == epochs {
            let t0 = Instant::now();
            memory::enter(Phase::Evaluation);
            if let Some(m) = memory::check(task.evaluate(Split::Valid, ddp.comm(), slow_ctx(step)))?
            {
                let secs = t0.elapsed().as_secs_f64();
                let value = m.get(&metric).unwrap_or(f64::NAN);
                let improved = progress.best.as_ref().is_none_or(|b| value > b.value);
                if let Some(file) = metrics.as_mut() {
                    file.append(&eval_record("valid", epochs_done, step, &m, secs))?;
                }
                if improved {
                    let previous = progress.best.replace(BestRecord {
                        epoch: epochs_done,
                        step,
                        metric: metric.clone(),
                        value,
                        valid: m.clone(),
                    });
                    progress.evals_since_best = 0;
                    let state = TrainState {
                        epoch: epochs_done,
                        step,
                        samples_in_epoch: 0,
                        best: progress.best.clone(),
                        ..start.clone()
                    };
                    save_checkpoint(
                        &mut ddp,
                        &[],
                        &setup.run_dir.join("best"),
                        state,
                        1,
                        slow_ctx(step),
                    )?;
                    if leader {
                        let was = previous.map_or(String::new(), |p| {
                            format!(", was {:.4} at epoch {}", p.value, p.epoch)
                        });
                        let line = format!(
                            "valid epoch {epochs_done}: {} ({secs:.1} s) — new best {metric} {value:.4}{was}",
                            m.summary_line()
                        );
                        match &bar {
                            Some(bar) => bar.suspend(|| info!("{line}")),
                            None => info!("{line}"),
                        }
                    }
                } else {
                    progress.evals_since_best += 1;
                    let patience = config.eval.patience;
                    let best = progress.best.as_ref().map_or(f64::NAN, |b| b.value);
                    if leader {
                        let line = format!(
                            "valid epoch {epochs_done}: {} ({secs:.1} s) — {metric} {value:.4}, best {best:.4} ({} evaluation(s) without improvement{})",
                            m.summary_line(),
                            progress.evals_since_best,
                            if patience > 0 { format!(", patience {patience}") } else { String::new() }
                        );
                        match &bar {
                            Some(bar) => bar.suspend(|| info!("{line}")),
                            None => info!("{line}"),
                        }
                    }
                    if patience > 0 && progress.evals_since_best >= patience && epochs_done < epochs
                    {
                        progress.stopped_early = true;
                        if leader {
                            info!(
                                "early stopping after epoch {epochs_done}: {metric} has not improved for {patience} evaluation(s)"
                            );
                        }
                    }
                }
            }
        }
        checkpoint_at(&mut ddp, &optimizer, &progress, epoch + 1, step, 0)?;
        if progress.stopped_early {
            break;
        }
        if setup.stop_after_epoch == Some(epoch + 1) {
            if leader {
                warn!(
                    "stopping after epoch {} (GPTREC_STOP_AFTER_EPOCH)",
                    epoch + 1
                );
            }
            break;
        }
    }
    if let Some(bar) = bar.take() {
        bar.finish_and_clear();
    }
    ddp.check_params(step)?;

    // An interrupted run (the test hook) ends here, like a killed one would.
    let interrupted = setup
        .stop_after_epoch
        .is_some_and(|e| epochs_done == e && e < epochs && !progress.stopped_early);
    // The test evaluation of the best model: rank 0 reads it, everyone receives it.
    if progress.best.is_some() && !interrupted {
        let failure = if leader {
            load_best(&ddp.named_variables(), &setup.run_dir.join("best"))
                .err()
                .map(|e| e.to_string())
        } else {
            None
        };
        let failure: Option<String> =
            broadcast_json(ddp.comm(), leader.then_some(&failure), ctx(step))?;
        if let Some(why) = failure {
            return Err(TrainError::Resume(format!("loading the best model: {why}")));
        }
        ddp.broadcast_params(0)?;
    }
    let t0 = Instant::now();
    let test = if interrupted {
        None
    } else {
        memory::enter(Phase::Evaluation);
        memory::check(task.evaluate(Split::Test, ddp.comm(), slow_ctx(step)))?
    };
    if let (Some(m), Some(file)) = (&test, metrics.as_mut()) {
        let epoch = progress.best.as_ref().map_or(epochs_done, |b| b.epoch);
        file.append(&eval_record(
            "test",
            epoch,
            step,
            m,
            t0.elapsed().as_secs_f64(),
        ))?;
    }

    // Peak memory of every rank, for the report.
    let peak_rss = gather_u64(ddp.comm(), memory::peak_rss_bytes(), ctx(step))?;
    let peak_device = if device.is_cuda() {
        Some(gather_u64(
            ddp.comm(),
            memory::peak_bytes(device),
            ctx(step),
        )?)
    } else {
        None
    };
    let secs = train_start.elapsed().as_secs_f64();
    Ok(TrainReport {
        steps: step,
        epochs_done,
        last_loss,
        resumed_from,
        best: progress.best,
        test,
        stopped_early: progress.stopped_early,
        peak_rss,
        peak_device,
        samples_per_s: if steps_run > 0 {
            (steps_run * batch.global) as f64 / secs.max(1e-9)
        } else {
            0.0
        },
        seconds_per_epoch: (full_epochs > 0).then(|| full_epoch_secs / full_epochs as f64),
    })
}

/// What early stopping remembers between evaluations (and across a resume).
struct EvalProgress {
    best: Option<BestRecord>,
    evals_since_best: u32,
    stopped_early: bool,
}

/// Copies the model saved in `<run dir>/best/` into `params`.
fn load_best(params: &[(String, Tensor)], dir: &Path) -> Result<(), TrainError> {
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

/// A progress bar on rank 0 only when a person watches: stderr is a terminal and
/// `GPTREC_PROGRESS` is not `plain`.
fn progress_bar_wanted() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var("GPTREC_PROGRESS").map_or(true, |v| v != "plain")
}

/// `1h02m`, `3m05s`, `12s`.
fn format_duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match (s / 3600, (s % 3600) / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// One number from every rank, in rank order.
pub fn gather_u64(
    comm: &mut dyn Collective,
    value: u64,
    ctx: OpContext,
) -> Result<Vec<u64>, TrainError> {
    let mine = Tensor::from_slice(&[value.min(i64::MAX as u64) as i64]);
    Ok(comm
        .all_gather(&mine, ctx)?
        .iter()
        .map(|t| t.f_int64_value(&[0]).map(|v| v.max(0) as u64))
        .collect::<Result<Vec<u64>, _>>()?)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Rank 0 writes the checkpoint; then every rank learns whether it succeeded (the exchange is
/// also the barrier that keeps the others from running ahead of it).
fn save_checkpoint(
    ddp: &mut Ddp,
    optimizer_state: &[(String, Tensor)],
    dir: &Path,
    mut state: TrainState,
    keep: usize,
    ctx: OpContext,
) -> Result<(), TrainError> {
    state.world_size = ddp.world_size() as u64;
    let mut failure = None;
    if ddp.rank() == 0 {
        match checkpoint::save(dir, &ddp.named_variables(), optimizer_state, &state, keep) {
            Ok(path) => info!("checkpoint {}", path.display()),
            Err(e) => {
                failure = Some(TrainError::Plan(format!(
                    "writing the checkpoint of step {}: {e}",
                    state.step
                )))
            }
        }
    }
    let mut flag = [Tensor::from_slice(&[if failure.is_some() {
        1.0f32
    } else {
        0.0
    }])];
    ddp.comm()
        .all_reduce(&mut flag, crate::collective::ReduceOp::Sum, ctx)?;
    match failure {
        Some(e) => Err(e),
        None if flag[0].f_double_value(&[0])? > 0.0 => {
            // Rank 0 has the real error: let it fail first, so the launcher names it as the
            // root cause and stops this rank; give up on our own only if nobody does.
            std::thread::sleep(LEADER_FAILS_FIRST);
            Err(TrainError::Plan(format!(
                "rank 0 could not write the checkpoint of step {} (see its message)",
                state.step
            )))
        }
        None => Ok(()),
    }
}

/// Rank 0's answer to "do we resume, and from where?", shared with every rank.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct ResumeDecision {
    path: Option<String>,
    state: Option<TrainState>,
    error: Option<String>,
}

fn resume_decision(
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
fn load_params(params: &[(String, Tensor)], saved: &[(String, Tensor)]) -> Result<(), TrainError> {
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
const RNG_SCHEME: &str = "torch generator reseeded before every optimizer step from (run.seed, step, rank); sampler order from (run.seed, epoch)";

/// How long the other ranks wait for rank 0 to exit after it failed to write a checkpoint.
const LEADER_FAILS_FIRST: Duration = Duration::from_secs(30);

/// Waits on rank 0's file work (checkpoints) get at least this long.
const SLOW_WORK_TIMEOUT: Duration = Duration::from_secs(600);

/// The torch seed of optimizer step `step` on `rank`.
/// A task as the DDP engine runs it, micro-batch by micro-batch.
struct TaskMicroBatches<'a>(&'a mut dyn Task);

impl MicroBatchLoss<Vec<usize>> for TaskMicroBatches<'_> {
    fn loss(&mut self, indices: &Vec<usize>) -> Result<Tensor, tch::TchError> {
        self.0.loss(indices)
    }

    fn finish_backward(&mut self) -> Result<(), tch::TchError> {
        self.0.finish_backward()
    }
}

fn step_seed(seed: u64, step: u64, rank: usize) -> i64 {
    // SplitMix64 of the three, so nearby steps and ranks get unrelated streams.
    let mut x = seed
        ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (rank as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((x ^ (x >> 31)) >> 1) as i64
}

/// Rank 0, once the start is known: moves aside what this run does not own (checkpoints above
/// its start, a best model its state does not name, an earlier run's metrics on a fresh start),
/// points `latest` at the checkpoint it resumed from, and cuts `metrics.jsonl` back to the
/// records up to the start (whole lines only).
fn own_the_run_dir(run_dir: &Path, start: &TrainState, resumed: bool) -> Result<(), TrainError> {
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

/// The largest JSON message rank 0 broadcasts (a resume decision, a failure text).
const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Broadcasts a JSON-serialisable value from rank 0 (`Some` there, `None` elsewhere).
fn broadcast_json<T: Serialize + for<'de> Deserialize<'de>>(
    comm: &mut dyn Collective,
    value: Option<&T>,
    ctx: OpContext,
) -> Result<T, TrainError> {
    let bytes = match value {
        Some(v) => serde_json::to_vec(v).map_err(|e| TrainError::Plan(e.to_string()))?,
        None => Vec::new(),
    };
    let mut len = [Tensor::from_slice(&[bytes.len() as i64])];
    comm.broadcast(&mut len, 0, ctx)?;
    // Checked before anything is allocated for it.
    let n = usize::try_from(len[0].f_int64_value(&[0])?)
        .ok()
        .filter(|&n| n <= MAX_MESSAGE_BYTES)
        .ok_or_else(|| {
            TrainError::Plan("rank 0 announced a message of an impossible size".into())
        })?;
    let mut data = [if bytes.len() == n {
        Tensor::from_slice(&bytes)
    } else {
        Tensor::zeros([n as i64], (tch::Kind::Uint8, tch::Device::Cpu))
    }];
    comm.broadcast(&mut data, 0, ctx)?;
    let mut received = vec![0u8; n];
    data[0].f_copy_data_u8(&mut received, n)?;
    serde_json::from_slice(&received)
        .map_err(|e| TrainError::Plan(format!("rank 0 sent an unreadable message: {e}")))
}

fn io(path: &Path, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}
