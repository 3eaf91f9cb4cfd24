//! The training loop around the DDP engine, as a [`Trainer`] whose methods are the steps of a
//! run: resume, each epoch of steps (sampler → micro-batches → optimizer step, LR schedule,
//! logging to the console and `metrics.jsonl`), the validation cadence with the best model and
//! early stopping, the checkpoint cadence (rank 0 writes, the others wait), the test evaluation
//! of the best model, and the final report. It works on any [`Task`] — a model plus a loss over a
//! batch of sample indices — and must not know what the model is.

mod records;
mod resume;
mod sync;
mod task;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::batch::BatchPlan;
use common::config::{Config, LrScheduleKind};
use tch::{nn, Device};
use tracing::{info, warn};

use crate::checkpoint::{self, BestRecord, NamedTensors, TrainState};
use crate::collective::{Collective, CollectiveError, OpContext};
use crate::ddp::{Ddp, DdpConfig, DdpError, StepStats};
use crate::eval::Metrics;
use crate::memory::{self, Phase};
use crate::optim::{AdamW, LrSchedule, Schedule};
use crate::run_dir::MetricsLog;
use crate::sampler::DistributedSampler;

pub use records::{eval_record, StepRecord};
pub use sync::gather_u64;
pub use task::{Split, Task};

use resume::{EvalProgress, ResumeDecision};
use sync::{broadcast_json, save_checkpoint};

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
    let mut trainer = Trainer::new(task, vs, comm, setup)?;
    trainer.resume()?;
    trainer.prepare_run_dir()?;
    trainer.fit()?;
    let test = trainer.test()?;
    trainer.report(test)
}

/// Waits on rank 0's file work (checkpoints) get at least this long.
const SLOW_WORK_TIMEOUT: Duration = Duration::from_secs(600);

/// Counters of the run as it goes.
#[derive(Debug)]
struct Progress {
    step: u64,
    last_loss: Option<f64>,
    epochs_done: u64,
    /// Steps and full epochs this process ran (not those of a run it resumed).
    steps_run: u64,
    full_epochs: u64,
    full_epoch_secs: f64,
    started: Instant,
}

/// One run of training: the engine, the optimizer and schedule, the sampler, what the run
/// started from, and its progress.
struct Trainer<'t> {
    task: &'t mut dyn Task,
    setup: &'t TrainSetup<'t>,
    ddp: Ddp,
    optimizer: AdamW,
    schedule: LrSchedule,
    sampler: DistributedSampler,
    device: Device,
    timeout: Duration,
    epochs: u64,
    steps_per_epoch: u64,
    /// The schedule's length (kept across resumes).
    total_steps: u64,
    /// `eval.metric`, lower-cased.
    metric: String,
    /// Where this run starts: step 0, or the checkpoint it resumed from.
    start: TrainState,
    resumed_from: Option<PathBuf>,
    eval: EvalProgress,
    progress: Progress,
    /// Rank 0: `metrics.jsonl` and, in a terminal, a progress bar.
    metrics: Option<MetricsLog>,
    bar: Option<indicatif::ProgressBar>,
}

impl<'t> Trainer<'t> {
    /// The engine (parameters broadcast from rank 0), the sampler, the schedule and a fresh
    /// start at step 0.
    fn new(
        task: &'t mut dyn Task,
        vs: &nn::VarStore,
        comm: Box<dyn Collective>,
        setup: &'t TrainSetup<'t>,
    ) -> Result<Trainer<'t>, TrainError> {
        let (config, batch) = (setup.config, setup.batch);
        let timeout = Duration::from_secs(config.dist.timeout_s);
        let ddp = Ddp::new(
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
        let total_steps = epochs * steps_per_epoch;
        let optimizer = AdamW::new(ddp.params(), 0.9, 0.999, 1e-8, config.train.weight_decay);
        let start = TrainState {
            epoch: 0,
            step: 0,
            samples_in_epoch: 0,
            seed: config.run.seed,
            world_size: world as u64,
            global_batch: batch.global,
            model_hash: task.model_hash(),
            rng: resume::RNG_SCHEME.to_string(),
            files: Default::default(),
            best: None,
            evals_since_best: 0,
            stopped_early: false,
            schedule_steps: Some(total_steps),
        };
        Ok(Trainer {
            schedule: lr_schedule(config, world, total_steps),
            task,
            setup,
            ddp,
            optimizer,
            sampler,
            device: vs.device(),
            timeout,
            epochs,
            steps_per_epoch,
            total_steps,
            metric: config.eval.metric.trim().to_ascii_lowercase(),
            start,
            resumed_from: None,
            eval: EvalProgress::default(),
            progress: Progress {
                step: 0,
                last_loss: None,
                epochs_done: 0,
                steps_run: 0,
                full_epochs: 0,
                full_epoch_secs: 0.0,
                started: Instant::now(),
            },
            metrics: None,
            bar: None,
        })
    }

    fn leader(&self) -> bool {
        self.ddp.rank() == 0
    }

    fn ctx(&self, step: u64) -> OpContext {
        OpContext {
            step,
            timeout: self.timeout,
        }
    }

    /// Waits on work only rank 0 does (writing a checkpoint) get more time than a collective.
    fn slow_ctx(&self, step: u64) -> OpContext {
        OpContext {
            step,
            timeout: self.timeout.max(SLOW_WORK_TIMEOUT),
        }
    }

    fn checkpoints(&self) -> PathBuf {
        self.setup.run_dir.join("checkpoints")
    }

    /// Rank 0 finds, checks and loads the checkpoint, then tells everyone the outcome
    /// (including its failure, so nobody waits for a rank that gave up); the tensors travel by
    /// broadcast, so no shared file system is needed.
    fn resume(&mut self) -> Result<(), TrainError> {
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
        if let (Some(path), Some(state)) = (decision.path, decision.state) {
            self.continue_from(PathBuf::from(path), state)?;
        }
        Ok(())
    }

    /// Rank 0's decision, with the checkpoint already loaded into its model and optimizer.
    fn decide_resume(&mut self) -> ResumeDecision {
        let checkpoints = self.checkpoints();
        for line in crate::run_dir::clean_temporaries(&checkpoints) {
            info!("checkpoints: {line}");
        }
        let world = self.ddp.world_size();
        let mut decision = resume::resume_decision(
            self.setup.config,
            &checkpoints,
            self.task.model_hash(),
            self.setup.batch,
            world,
        );
        if let (Some(path), None) = (&decision.path, &decision.error) {
            let applied = checkpoint::load(Path::new(path))
                .map_err(|e| e.to_string())
                .and_then(|(model, optim, _)| {
                    self.load(&model, &optim)
                        .map_err(|e| format!("{path}: {e}"))
                });
            if let Err(e) = applied {
                decision.error = Some(e);
            }
        }
        decision
    }

    fn load(&mut self, model: &NamedTensors, optim: &NamedTensors) -> Result<(), TrainError> {
        resume::load_params(&self.ddp.named_variables(), model)?;
        self.optimizer
            .load_state_tensors(optim)
            .map_err(|e| TrainError::Resume(e.to_string()))
    }

    /// Every rank takes rank 0's parameters and optimizer state and the checkpoint's position;
    /// the schedule keeps the length the run started with.
    fn continue_from(&mut self, path: PathBuf, state: TrainState) -> Result<(), TrainError> {
        self.ddp.broadcast_params(0)?;
        // Everyone receives rank 0's optimizer state into tensors of the right shapes.
        let mut shaped = self.optimizer.state_tensors();
        let mut values: Vec<tch::Tensor> = shaped.iter().map(|(_, t)| t.shallow_clone()).collect();
        let ctx = self.ctx(state.step);
        self.ddp.comm().broadcast(&mut values, 0, ctx)?;
        for ((_, t), v) in shaped.iter_mut().zip(values) {
            *t = v;
        }
        self.optimizer
            .load_state_tensors(&shaped)
            .map_err(|e| TrainError::Resume(e.to_string()))?;
        let total = state.schedule_steps.unwrap_or(self.total_steps);
        if self.leader() {
            self.announce_resume(&path, &state, total);
        }
        memory::update(|f| f.last_checkpoint = Some(path.display().to_string()));
        memory::set_step(state.step);
        // Older checkpoints have no length: as computed now.
        self.total_steps = total;
        self.schedule.total_steps = total;
        self.start = TrainState {
            schedule_steps: Some(total),
            ..state
        };
        self.resumed_from = Some(path);
        Ok(())
    }

    fn announce_resume(&self, path: &Path, state: &TrainState, total: u64) {
        let world = self.ddp.world_size();
        info!(
            "resuming from {} (epoch {}, step {}, written by {} rank(s); now {world})",
            path.display(),
            state.epoch + 1,
            state.step,
            state.world_size
        );
        if state.world_size != world as u64 {
            warn!(
                "resuming with world {world} from a checkpoint of world {}: the run continues with the same global batch and learning-rate schedule ({total} steps), but not bit-exactly (each rank's share of the data and the order of the sums change)",
                state.world_size
            );
        }
    }

    /// Rank 0: the resolved config, a run directory holding only what this run owns, the
    /// metrics log and (in a terminal) the progress bar. Everyone: the progress so far.
    fn prepare_run_dir(&mut self) -> Result<(), TrainError> {
        self.eval = EvalProgress {
            best: self.start.best.clone(),
            evals_since_best: self.start.evals_since_best,
            stopped_early: self.start.stopped_early,
        };
        self.progress.step = self.start.step;
        self.progress.epochs_done = self.start.epoch;
        if !self.leader() {
            return Ok(());
        }
        let run_dir = &self.setup.run_dir;
        std::fs::create_dir_all(run_dir).map_err(|e| io(run_dir, e))?;
        let resolved = self
            .setup
            .config
            .to_toml()
            .map_err(|e| TrainError::Plan(e.to_string()))?;
        let path = run_dir.join("config.resolved.toml");
        std::fs::write(&path, resolved).map_err(|e| io(&path, e))?;
        resume::own_the_run_dir(run_dir, &self.start, self.resumed_from.is_some())?;
        self.metrics = Some(MetricsLog::open(&run_dir.join("metrics.jsonl"))?);
        self.bar = progress_bar_wanted().then(|| new_bar(self.total_steps, self.start.step));
        Ok(())
    }

    /// Epochs until the last, early stopping, or the interruption hook.
    fn fit(&mut self) -> Result<(), TrainError> {
        self.progress.started = Instant::now();
        let first = if self.eval.stopped_early {
            self.epochs
        } else {
            self.start.epoch
        };
        for epoch in first..self.epochs {
            self.run_epoch(epoch)?;
            self.validate_if_due()?;
            let step = self.progress.step;
            self.checkpoint(epoch + 1, step, 0)?;
            if self.eval.stopped_early {
                break;
            }
            if self.setup.stop_after_epoch == Some(epoch + 1) {
                if self.leader() {
                    warn!(
                        "stopping after epoch {} (GPTREC_STOP_AFTER_EPOCH)",
                        epoch + 1
                    );
                }
                break;
            }
        }
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        self.ddp.check_params(self.progress.step)?;
        Ok(())
    }

    /// The optimizer steps of one epoch (from where a resumed run stopped in it), with the
    /// step checkpoints `checkpoint.every_n_steps` asks for.
    fn run_epoch(&mut self, epoch: u64) -> Result<(), TrainError> {
        let world = self.ddp.world_size() as u64;
        let skip = if epoch == self.start.epoch {
            (self.start.samples_in_epoch / world) as usize
        } else {
            0
        };
        let (micro, grad_accum) = (
            self.setup.batch.micro as usize,
            self.setup.batch.grad_accum as usize,
        );
        let batches = self.sampler.batches(epoch, micro, skip, true);
        let mut samples_in_epoch = skip as u64 * world;
        let epoch_start = Instant::now();
        // Only whole windows: the rest does not fill a global batch.
        let windows = batches.len() / grad_accum;
        for (w, window) in batches.chunks(grad_accum).take(windows).enumerate() {
            self.train_step(epoch, window)?;
            samples_in_epoch += self.setup.batch.global;
            let (step, every) = (
                self.progress.step,
                self.setup.config.checkpoint.every_n_steps,
            );
            // The last step of an epoch is saved as the end of the epoch.
            if every > 0 && step % every == 0 && w + 1 < windows {
                self.checkpoint(epoch, step, samples_in_epoch)?;
            }
        }
        self.progress.epochs_done = epoch + 1;
        let secs = epoch_start.elapsed().as_secs_f64();
        if skip == 0 {
            self.progress.full_epochs += 1;
            self.progress.full_epoch_secs += secs;
        }
        self.say(format!(
            "epoch {}/{} done in {secs:.1} s",
            epoch + 1,
            self.epochs
        ));
        Ok(())
    }

    /// One optimizer step over `window` (one micro-batch per gradient-accumulation step).
    fn train_step(&mut self, epoch: u64, window: &[Vec<usize>]) -> Result<(), TrainError> {
        let t0 = Instant::now();
        let step = self.progress.step;
        // Any randomness of the task (dropout, negative sampling) is a function of
        // (seed, step, rank): an interrupted and resumed run draws exactly the same numbers.
        tch::manual_seed(step_seed(self.setup.config.run.seed, step, self.ddp.rank()));
        let lr = self.schedule.lr_at(step);
        let stats = self.ddp.step(
            window,
            &mut task::TaskMicroBatches(&mut *self.task),
            &mut self.optimizer,
            lr,
            step,
        )?;
        let step = step + 1;
        self.progress.step = step;
        memory::set_step(step);
        self.progress.steps_run += 1;
        self.progress.last_loss = Some(stats.loss);
        self.log_step(epoch, lr, &stats, t0.elapsed().as_secs_f64())
    }

    /// The step's record in `metrics.jsonl` (rank 0), and at logged steps every rank's peak
    /// memory and a log line (or the progress bar).
    fn log_step(
        &mut self,
        epoch: u64,
        lr: f64,
        stats: &StepStats,
        secs: f64,
    ) -> Result<(), TrainError> {
        let step = self.progress.step;
        let log_every = (self.steps_per_epoch / 10).max(1);
        let log_now = step % log_every == 0 || step == self.total_steps;
        // At logged steps every rank reports its peak; rank 0 logs the largest.
        let peak = if log_now {
            let ctx = self.ctx(step);
            let all = gather_u64(self.ddp.comm(), memory::peak_bytes(self.device), ctx)?;
            all.iter()
                .enumerate()
                .max_by_key(|(_, &b)| b)
                .map(|(r, &b)| (r as u64, b))
        } else {
            None
        };
        let global = self.setup.batch.global;
        let Some(file) = self.metrics.as_mut() else {
            return Ok(());
        };
        file.append(&StepRecord {
            kind: "step".into(),
            epoch: epoch + 1,
            step,
            loss: stats.loss,
            lr,
            grad_norm: stats.grad_norm,
            samples_per_s: global as f64 / secs.max(1e-9),
            peak_mem_mib: peak.map(|(_, b)| mib(b)),
            peak_mem_rank: peak.map(|(r, _)| r),
        })?;
        let p = &self.progress;
        let elapsed = p.started.elapsed().as_secs_f64();
        let rate = (p.steps_run * global) as f64 / elapsed.max(1e-9);
        if let Some(bar) = self.bar.as_mut() {
            bar.set_position(step);
            bar.set_message(format!(
                "epoch {}/{} loss {:.4} {rate:.0} samples/s",
                epoch + 1,
                self.epochs,
                stats.loss
            ));
        } else if log_now {
            let eta = elapsed / p.steps_run as f64 * self.total_steps.saturating_sub(step) as f64;
            let (peak_rank, peak_bytes) = peak.unwrap_or_default();
            info!(
                "epoch {}/{} step {step}/{} loss {:.6} lr {lr:.3e} grad_norm {:.4} {rate:.0} samples/s {:.1} ms/step, peak mem {:.0} MiB (rank {peak_rank}) ETA {}",
                epoch + 1,
                self.epochs,
                self.total_steps,
                stats.loss,
                stats.grad_norm,
                elapsed * 1000.0 / p.steps_run as f64,
                mib(peak_bytes),
                format_duration(eta)
            );
        }
        Ok(())
    }

    /// A checkpoint at (epoch, step, samples consumed in that epoch), with the early-stopping
    /// bookkeeping.
    fn checkpoint(
        &mut self,
        epoch: u64,
        step: u64,
        samples_in_epoch: u64,
    ) -> Result<(), TrainError> {
        let state = TrainState {
            epoch,
            step,
            samples_in_epoch,
            best: self.eval.best.clone(),
            evals_since_best: self.eval.evals_since_best,
            stopped_early: self.eval.stopped_early,
            ..self.start.clone()
        };
        let checkpoints = self.checkpoints();
        let ctx = self.slow_ctx(step);
        save_checkpoint(
            &mut self.ddp,
            &self.optimizer.state_tensors(),
            &checkpoints,
            state,
            self.setup.config.checkpoint.keep as usize,
            ctx,
        )?;
        let path = checkpoints.join(format!("step-{step:06}"));
        memory::update(|f| f.last_checkpoint = Some(path.display().to_string()));
        Ok(())
    }

    /// Validation every `eval.every_n_epochs` (and after the last epoch), before the epoch's
    /// checkpoint so that it knows the best so far.
    fn validate_if_due(&mut self) -> Result<(), TrainError> {
        let done = self.progress.epochs_done;
        let every = u64::from(self.setup.config.eval.every_n_epochs);
        if done % every != 0 && done != self.epochs {
            return Ok(());
        }
        let t0 = Instant::now();
        memory::enter(Phase::Evaluation);
        let ctx = self.slow_ctx(self.progress.step);
        let Some(m) = memory::check(self.task.evaluate(Split::Valid, self.ddp.comm(), ctx))? else {
            return Ok(());
        };
        let secs = t0.elapsed().as_secs_f64();
        let step = self.progress.step;
        if let Some(file) = self.metrics.as_mut() {
            file.append(&eval_record("valid", done, step, &m, secs))?;
        }
        let value = m.get(&self.metric).unwrap_or(f64::NAN);
        if self.eval.best.as_ref().is_none_or(|b| value > b.value) {
            self.new_best(m, value, secs)
        } else {
            self.no_improvement(&m, value, secs);
            Ok(())
        }
    }

    /// Saves the model as the best one (`<run dir>/best/`).
    fn new_best(&mut self, m: Metrics, value: f64, secs: f64) -> Result<(), TrainError> {
        let (done, step) = (self.progress.epochs_done, self.progress.step);
        let line = format!("valid epoch {done}: {} ({secs:.1} s)", m.summary_line());
        let previous = self.eval.best.replace(BestRecord {
            epoch: done,
            step,
            metric: self.metric.clone(),
            value,
            valid: m,
        });
        self.eval.evals_since_best = 0;
        let state = TrainState {
            epoch: done,
            step,
            samples_in_epoch: 0,
            best: self.eval.best.clone(),
            ..self.start.clone()
        };
        let ctx = self.slow_ctx(step);
        let best_dir = self.setup.run_dir.join("best");
        save_checkpoint(&mut self.ddp, &[], &best_dir, state, 1, ctx)?;
        let was = previous.map_or(String::new(), |p| {
            format!(", was {:.4} at epoch {}", p.value, p.epoch)
        });
        self.say(format!("{line} — new best {} {value:.4}{was}", self.metric));
        Ok(())
    }

    /// Counts an evaluation without improvement; stops early when patience runs out.
    fn no_improvement(&mut self, m: &Metrics, value: f64, secs: f64) {
        let done = self.progress.epochs_done;
        self.eval.evals_since_best += 1;
        let patience = self.setup.config.eval.patience;
        let best = self.eval.best.as_ref().map_or(f64::NAN, |b| b.value);
        self.say(format!(
            "valid epoch {done}: {} ({secs:.1} s) — {} {value:.4}, best {best:.4} ({} evaluation(s) without improvement{})",
            m.summary_line(),
            self.metric,
            self.eval.evals_since_best,
            if patience > 0 { format!(", patience {patience}") } else { String::new() }
        ));
        if patience > 0 && self.eval.evals_since_best >= patience && done < self.epochs {
            self.eval.stopped_early = true;
            self.say(format!(
                "early stopping after epoch {done}: {} has not improved for {patience} evaluation(s)",
                self.metric
            ));
        }
    }

    /// The test evaluation of the best model (rank 0 reads it, everyone receives it), unless
    /// the run was interrupted by the test hook.
    fn test(&mut self) -> Result<Option<Metrics>, TrainError> {
        let done = self.progress.epochs_done;
        let interrupted = self
            .setup
            .stop_after_epoch
            .is_some_and(|e| done == e && e < self.epochs && !self.eval.stopped_early);
        if interrupted {
            return Ok(None);
        }
        let step = self.progress.step;
        if self.eval.best.is_some() {
            self.load_best(step)?;
        }
        let t0 = Instant::now();
        memory::enter(Phase::Evaluation);
        let ctx = self.slow_ctx(step);
        let test = memory::check(self.task.evaluate(Split::Test, self.ddp.comm(), ctx))?;
        if let (Some(m), Some(file)) = (&test, self.metrics.as_mut()) {
            let epoch = self.eval.best.as_ref().map_or(done, |b| b.epoch);
            file.append(&eval_record(
                "test",
                epoch,
                step,
                m,
                t0.elapsed().as_secs_f64(),
            ))?;
        }
        Ok(test)
    }

    fn load_best(&mut self, step: u64) -> Result<(), TrainError> {
        let leader = self.leader();
        let failure = if leader {
            resume::load_best(
                &self.ddp.named_variables(),
                &self.setup.run_dir.join("best"),
            )
            .err()
            .map(|e| e.to_string())
        } else {
            None
        };
        let ctx = self.ctx(step);
        let failure: Option<String> =
            broadcast_json(self.ddp.comm(), leader.then_some(&failure), ctx)?;
        if let Some(why) = failure {
            return Err(TrainError::Resume(format!("loading the best model: {why}")));
        }
        self.ddp.broadcast_params(0)?;
        Ok(())
    }

    /// Peak memory of every rank, and how the run went.
    fn report(mut self, test: Option<Metrics>) -> Result<TrainReport, TrainError> {
        let ctx = self.ctx(self.progress.step);
        let peak_rss = gather_u64(self.ddp.comm(), memory::peak_rss_bytes(), ctx)?;
        let peak_device = if self.device.is_cuda() {
            let peak = memory::peak_bytes(self.device);
            Some(gather_u64(self.ddp.comm(), peak, ctx)?)
        } else {
            None
        };
        let p = &self.progress;
        let secs = p.started.elapsed().as_secs_f64();
        Ok(TrainReport {
            steps: p.step,
            epochs_done: p.epochs_done,
            last_loss: p.last_loss,
            resumed_from: self.resumed_from,
            best: self.eval.best,
            test,
            stopped_early: self.eval.stopped_early,
            peak_rss,
            peak_device,
            samples_per_s: if p.steps_run > 0 {
                (p.steps_run * self.setup.batch.global) as f64 / secs.max(1e-9)
            } else {
                0.0
            },
            seconds_per_epoch: (p.full_epochs > 0)
                .then(|| p.full_epoch_secs / p.full_epochs as f64),
        })
    }

    /// A log line of rank 0, printed above the progress bar when there is one.
    fn say(&self, line: String) {
        if !self.leader() {
            return;
        }
        match &self.bar {
            Some(bar) => bar.suspend(|| info!("{line}")),
            None => info!("{line}"),
        }
    }
}

/// The learning-rate schedule of `[train]` over `total_steps`.
fn lr_schedule(config: &Config, world: usize, total_steps: u64) -> LrSchedule {
    let peak_lr = if config.train.scale_lr_with_world {
        config.train.lr * world as f64
    } else {
        config.train.lr
    };
    LrSchedule {
        peak_lr,
        warmup_steps: config.train.warmup_steps,
        total_steps,
        schedule: match config.train.lr_schedule {
            LrScheduleKind::Cosine => Schedule::Cosine,
            LrScheduleKind::Linear => Schedule::Linear,
            LrScheduleKind::Constant => Schedule::Constant,
        },
        min_lr: config.train.min_lr,
    }
}

/// A progress bar on rank 0 only when a person watches: stderr is a terminal and
/// `GPTREC_PROGRESS` is not `plain`.
fn progress_bar_wanted() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var("GPTREC_PROGRESS").map_or(true, |v| v != "plain")
}

fn new_bar(total_steps: u64, position: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total_steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] step {pos}/{len} ETA {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_position(position);
    bar
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

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The torch seed of optimizer step `step` on `rank`.
fn step_seed(seed: u64, step: u64, rank: usize) -> i64 {
    // SplitMix64 of the three, so nearby steps and ranks get unrelated streams.
    let mut x = seed
        ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (rank as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((x ^ (x >> 31)) >> 1) as i64
}

fn io(path: &Path, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}
