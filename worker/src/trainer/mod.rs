//! The training loop around the DDP engine, as a [`Trainer`] whose methods are the steps of a
//! run: resume, each epoch of steps (sampler → micro-batches → optimizer step, LR schedule,
//! logging to the console and `metrics.jsonl`), the validation cadence with the best model and
//! early stopping, the checkpoint cadence (rank 0 writes, the others wait), the test evaluation
//! of the best model, and the final report. It works on any [`Task`] — a model plus a loss over a
//! batch of sample indices — and must not know what the model is.

mod evaluation;
mod faults;
mod logging;
mod progress;

pub use faults::slow_start_fault;
use progress::{Progress, Spent};
pub use progress::{Seconds, WARM_UP_STEPS};
mod rank_time;
mod records;
mod resume;
mod sync;
mod task;
mod trace;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::config::{Config, OffloadKind};
use common::train_plan::TrainPlan;
use tch::{nn, Device};
use tracing::warn;

use crate::memory::{self, PhaseTracker};
use crate::run_dir::MetricsLog;
use recommender::eval::Metrics;
use runtime::checkpoint::{self, TrainState};
use runtime::collective::{Collective, CollectiveError, OpContext};
use runtime::ddp::{Ddp, DdpConfig, DdpError};
use runtime::optim::{AdamW, LrSchedule};
use runtime::sampler::DistributedSampler;

pub use recommender::Split;
pub use records::{baseline_record, eval_record, StepRecord};
pub use sync::gather_u64;
pub use task::Task;

use faults::Faults;
use logging::{new_bar, progress_bar_wanted};
pub use rank_time::{lines as rank_time_lines, straggler, RankTime};
use resume::EvalProgress;
pub use resume::{load_best, BestRecord};
use sync::{broadcast_json, save_checkpoint, save_linked};

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
    /// `launch` asked the group to re-form (SIGUSR1): it stopped after this checkpoint.
    #[error("stopped after the checkpoint of step {step}: launch asked the group to re-form (a node waits to join)")]
    Regroup { step: u64 },
    /// A SIGTERM (preemption) reached a rank during the steps: every rank stopped after this
    /// step, checkpointed.
    #[error("preempted (SIGTERM): stopped after step {step} with its checkpoint {checkpoint}; run the same command again to resume from it")]
    Preempted { step: u64, checkpoint: String },
}

impl TrainError {
    /// Every rank stopped together at a checkpoint, to be resumed (re-forming, preemption):
    /// exit code [`common::env_contract::EXIT_REGROUP`], not a failure.
    pub fn is_planned_stop(&self) -> bool {
        matches!(
            self,
            TrainError::Regroup { .. } | TrainError::Preempted { .. }
        )
    }
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
    /// The best model's metrics on the cold-start splits the task has (empty without).
    pub cold: Vec<(Split, Metrics)>,
    /// Patience ran out before `train.epochs`.
    pub stopped_early: bool,
    /// Peak resident memory of each rank (bytes, from the kernel's high-water mark).
    pub peak_rss: Vec<u64>,
    /// Peak device memory of each rank (bytes, NVML) when training ran on GPUs.
    pub peak_device: Option<Vec<u64>>,
    /// Training samples per second over the wall time of the steps this run took (0 when it
    /// took none): evaluations and checkpoints excluded ([`TrainReport::seconds`] has them).
    pub samples_per_s: f64,
    /// The same after the first [`WARM_UP_STEPS`] steps (`None` without more steps than that).
    pub steady_samples_per_s: Option<f64>,
    /// This rank's time per step by phase after the warm-up steps (`None` as above).
    pub steady_rank_time: Option<RankTime>,
    /// Where this run's time went.
    pub seconds: Seconds,
    /// Mean seconds per epoch over the epochs this run trained in full.
    pub seconds_per_epoch: Option<f64>,
    /// Each rank's time per step, in rank order (empty when this run took no step).
    pub rank_times: Vec<RankTime>,
    /// Bytes each rank handed to the others per optimizer step of this run, in rank order
    /// (`Collective::bytes_sent` over the steps, divided by their number; empty when the
    /// backend does not count or no step was taken).
    pub sent_per_step: Vec<u64>,
    /// Optimizer steps this run took (0 when it only evaluated a finished run).
    pub steps_run: u64,
    /// The summary record of the run that ended where this one started (rank 0), whose
    /// training figures stand when this run took no step.
    pub earlier_summary: Option<serde_json::Value>,
}

/// Everything the loop needs besides the task.
pub struct TrainSetup<'a> {
    /// The config and the batch plan (as `batch.micro = "auto"` measured it, if it did).
    pub plan: &'a TrainPlan,
    pub run_dir: PathBuf,
    /// Told the phase and step as the run goes (the out-of-memory report).
    pub memory: PhaseTracker,
    /// Stop cleanly after this many epochs (a test hook that simulates an interrupted run;
    /// `GPTREC_STOP_AFTER_EPOCH`).
    pub stop_after_epoch: Option<u64>,
    /// A baseline's record ([`baseline_record`]) that rank 0 writes at the head of a
    /// fresh run's `metrics.jsonl`.
    pub baseline: Option<serde_json::Value>,
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
    let tested = trainer.timed(Spent::Evaluation, Trainer::test)?;
    // Whatever reads the model after training finds its values (ZeRO stage 3 keeps shards).
    trainer.ddp.gather_params()?;
    // A finished run's files are on disk before it reports.
    trainer.checkpoints_on_disk(trainer.progress.step)?;
    trainer.report_progress(common::progress::Phase::Done, true);
    trainer.report(tested)
}

/// Waits on rank 0's file work (checkpoints) get at least this long.
const SLOW_WORK_TIMEOUT: Duration = Duration::from_secs(600);

/// How often the step probe measures the peak anew: on a GPU that is an NVML query, on the CPU
/// a read of `/proc`, both too slow for every step of a fast model.
const PEAK_SAMPLE_EVERY: Duration = Duration::from_millis(500);

/// The step probe of this rank's peak memory (MiB), measured at most every
/// [`PEAK_SAMPLE_EVERY`] and the last figure repeated in between.
fn peak_memory_probe(memory: PhaseTracker, device: Device) -> runtime::ddp::StepProbe {
    let mut last: Option<(Instant, f64)> = None;
    Box::new(move || match last {
        Some((at, mib)) if at.elapsed() < PEAK_SAMPLE_EVERY => mib,
        _ => {
            let mib = memory::mib(memory.peak_bytes(device));
            last = Some((Instant::now(), mib));
            mib
        }
    })
}

/// What the engine is told of the run: the batch plan's accumulation and the `[dist]` keys.
fn ddp_config(setup: &TrainSetup<'_>, task: &dyn Task, timeout: Duration) -> DdpConfig {
    let (config, batch) = (&setup.plan.config, setup.plan.batch);
    DdpConfig {
        grad_accum: batch.grad_accum as usize,
        bucket_bytes: (config.dist.bucket_mb * 1024.0 * 1024.0) as usize,
        max_grad_norm: config.train.max_grad_norm,
        check_params_every: config.dist.check_params_every,
        timeout,
        sparse: if config.dist.sparse_embeddings {
            task.embedding_tables()
        } else {
            Vec::new()
        },
        shared_tables: config.dist.shared_tables,
        shard_optimizer: config.dist.shard_optimizer,
        overlap_backward: config.dist.overlap_backward,
        zero: config.dist.zero.stage(),
        units: task.units(),
        offload: config.dist.offload == OffloadKind::Optimizer,
    }
}

/// Optimizer steps in one epoch of this rank's shard; an error when not even one global batch
/// fits in the training data.
fn steps_per_epoch(
    setup: &TrainSetup<'_>,
    task: &dyn Task,
    sampler: &DistributedSampler,
) -> Result<u64, TrainError> {
    let batch = setup.plan.batch;
    let per_rank_step = (batch.micro * batch.grad_accum) as usize;
    let steps = (sampler.num_samples() / per_rank_step) as u64;
    if steps == 0 {
        return Err(TrainError::Plan(format!(
            "{} training samples are fewer than one global batch of {} ({}); lower batch.global",
            task.train_len(),
            batch.global,
            batch.derivation()
        )));
    }
    Ok(steps)
}

/// The state of a run that starts at step 0 (what a checkpoint of it will carry).
fn fresh_state(
    setup: &TrainSetup<'_>,
    task: &dyn Task,
    world: usize,
    total_steps: u64,
) -> TrainState {
    let config = &setup.plan.config;
    TrainState {
        epoch: 0,
        step: 0,
        samples_in_epoch: 0,
        seed: config.run.seed,
        world_size: world as u64,
        global_batch: setup.plan.batch.global,
        model_hash: task.model_hash(),
        rng: resume::RNG_SCHEME.to_string(),
        files: Default::default(),
        trainer: Default::default(),
        schedule_steps: Some(total_steps),
    }
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
    /// Rank 0's whole optimizer state as read from a checkpoint, kept until every rank has
    /// taken its share, where the optimizer keeps only this rank's shard (ZeRO).
    loaded_optimizer: Option<Vec<(String, tch::Tensor)>>,
    /// See [`TrainReport::earlier_summary`].
    earlier_summary: Option<serde_json::Value>,
    eval: EvalProgress,
    progress: Progress,
    /// Rank 0: `metrics.jsonl` and, in a terminal, a progress bar.
    metrics: Option<MetricsLog>,
    bar: Option<indicatif::ProgressBar>,
    /// Every rank: reports for `launch`'s live display, when it asked for them.
    reports: Option<crate::progress_channel::ProgressSender>,
    /// `GPTREC_FAULT_SLOW` on this rank.
    slow: Option<Duration>,
    /// `GPTREC_FAULT_STOP`: the step (from 1) before which this rank stops itself.
    stop_before: Option<u64>,
    /// `GPTREC_FAULT_DIE`: the step (from 1) before which this rank kills itself.
    die_before: Option<u64>,
    /// [`Faults::term_launch_at`].
    term_launch_at: Option<u64>,
    /// `GPTREC_TRACE_SAMPLES`: the samples of every step, for tests.
    trace: Option<trace::SampleTrace>,
    /// Rank 0: checkpoints made durable while training goes on.
    saver: checkpoint::Background,
    /// The step at which this process saved the best model: until another step runs, the
    /// parameters are the best model's (testing need not read it back).
    best_saved_at: Option<u64>,
    /// The step of a best model found and not yet saved: its model file is a link to the one of
    /// its epoch's checkpoint, once that is saved.
    best_to_save: Option<u64>,
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
        let config = &setup.plan.config;
        let timeout = Duration::from_secs(config.dist.timeout_s);
        let mut ddp = Ddp::new(comm, vs, ddp_config(setup, &*task, timeout))?;
        // Under ZeRO stage 3 the model gathers its units through the engine's gate.
        if let Some(gate) = ddp.param_gate() {
            task.set_param_gate(gate);
        }
        let (rank, world) = (ddp.rank(), ddp.world_size());
        if rank == 0 {
            let grad_accum = setup.plan.batch.grad_accum as usize;
            logging::log_sharing(&ddp, config, grad_accum);
        }
        ddp.set_probe(peak_memory_probe(setup.memory.clone(), vs.device()));
        if let Some(flag) = crate::preempt::flag() {
            ddp.set_stop_flag(flag);
        }
        let faults = Faults::from_env(rank)?;
        let sampler = DistributedSampler::new(task.train_len(), world, rank, config.run.seed)
            .map_err(|e| TrainError::Plan(e.to_string()))?;
        let steps_per_epoch = steps_per_epoch(setup, &*task, &sampler)?;
        let epochs = u64::from(config.train.epochs);
        let total_steps = epochs * steps_per_epoch;
        let optimizer = ddp.optimizer(0.9, 0.999, 1e-8, config.train.weight_decay);
        let start = fresh_state(setup, &*task, world, total_steps);
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
            loaded_optimizer: None,
            earlier_summary: None,
            eval: EvalProgress::default(),
            progress: Progress::new(),
            metrics: None,
            bar: None,
            reports: crate::progress_channel::ProgressSender::from_env(),
            slow: faults.slow,
            stop_before: faults.stop_before,
            die_before: faults.die_before,
            term_launch_at: faults.term_launch_at,
            trace: trace::SampleTrace::from_env(rank),
            saver: checkpoint::Background::default(),
            best_saved_at: None,
            best_to_save: None,
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

    /// Rank 0: the resolved config, a run directory holding only what this run owns, the
    /// metrics log and (in a terminal) the progress bar. Everyone: the progress so far.
    fn prepare_run_dir(&mut self) -> Result<(), TrainError> {
        self.eval = EvalProgress::from_state(&self.start)?;
        self.progress.step = self.start.step;
        self.progress.epochs_done = self.start.epoch;
        if !self.leader() {
            return Ok(());
        }
        let run_dir = &self.setup.run_dir;
        std::fs::create_dir_all(run_dir).map_err(|e| io(run_dir, e))?;
        let resolved = self
            .setup
            .plan
            .config
            .to_toml()
            .map_err(|e| TrainError::Plan(e.to_string()))?;
        let path = run_dir.join("config.resolved.toml");
        std::fs::write(&path, resolved).map_err(|e| io(&path, e))?;
        self.earlier_summary =
            resume::own_the_run_dir(run_dir, &self.start, self.resumed_from.as_deref())?;
        // `tensorboard --logdir <output_dir>` shows every run's curves (a new event file per
        // start; TensorBoard reads them all).
        let resumed_after = self.resumed_from.as_ref().map(|_| self.start.step);
        let mut metrics = MetricsLog::open(&run_dir.join("metrics.jsonl"))?
            .with_tensorboard(&run_dir.join("tensorboard"), resumed_after);
        if let (None, Some(baseline)) = (&self.resumed_from, &self.setup.baseline) {
            metrics.append(baseline)?;
        }
        self.metrics = Some(metrics);
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
            self.timed(Spent::Evaluation, Self::validate_if_due)?;
            let step = self.progress.step;
            self.timed(Spent::Checkpoint, |t| {
                t.checkpoint(epoch + 1, step, 0)?;
                t.save_best(step)
            })?;
            if self.eval.stopped_early {
                break;
            }
            if epoch + 1 < self.epochs {
                self.regroup_if_asked(step)?;
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
            self.setup.plan.batch.micro as usize,
            self.setup.plan.batch.grad_accum as usize,
        );
        let batches = self.sampler.batches(epoch, micro, skip, true);
        let mut samples_in_epoch = skip as u64 * world;
        let epoch_start = Instant::now();
        // Only whole windows: the rest does not fill a global batch.
        let windows = batches.len() / grad_accum;
        let _steps = crate::preempt::Steps::enter();
        for (w, window) in batches.chunks(grad_accum).take(windows).enumerate() {
            let stop_requested = self.train_step(epoch, window)?;
            if let Some(trace) = self.trace.as_mut() {
                trace.record(epoch, self.progress.step, window);
            }
            samples_in_epoch += self.setup.plan.batch.global;
            let (step, every) = (
                self.progress.step,
                self.setup.plan.config.checkpoint.every_n_steps,
            );
            if stop_requested {
                return self.stop_preempted(epoch, step, samples_in_epoch);
            }
            // The last step of an epoch is saved as the end of the epoch.
            if every > 0 && step % every == 0 && w + 1 < windows {
                self.timed(Spent::Checkpoint, |t| {
                    t.checkpoint(epoch, step, samples_in_epoch)
                })?;
                self.regroup_if_asked(step)?;
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

    /// Preempted: a checkpoint of this step (mid-epoch, as `checkpoint.every_n_steps` makes
    /// them), on disk on every rank's word, then the stop ([`TrainError::Preempted`]).
    fn stop_preempted(
        &mut self,
        epoch: u64,
        step: u64,
        samples_in_epoch: u64,
    ) -> Result<(), TrainError> {
        self.checkpoint(epoch, step, samples_in_epoch)?;
        self.checkpoints_on_disk(step)?;
        let checkpoint = (self.checkpoints())
            .join(runtime::checkpoint::step_dir_name(step))
            .display()
            .to_string();
        Err(TrainError::Preempted { step, checkpoint })
    }

    /// One optimizer step over `window` (one micro-batch per gradient-accumulation step);
    /// whether some rank asked to stop after it (preemption).
    fn train_step(&mut self, epoch: u64, window: &[Vec<usize>]) -> Result<bool, TrainError> {
        let t0 = Instant::now();
        let step = self.progress.step;
        if self.stop_before == Some(step + 1) {
            // A hung peer, for tests: stopped until the teardown's SIGKILL.
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
        }
        if self.die_before == Some(step + 1) {
            // A dead peer, for tests: as a crash or the OOM killer would end it.
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
        // Any randomness of the task (dropout, negative sampling) is a function of
        // (seed, step, rank): an interrupted and resumed run draws exactly the same numbers.
        tch::manual_seed(step_seed(
            self.setup.plan.config.run.seed,
            step,
            self.ddp.rank(),
        ));
        self.task.begin_step(step);
        let lr = self.schedule.lr_at(step);
        let sent_before = self.ddp.comm().bytes_sent();
        // An allocation failure is reported (and the rank exits) before anything else happens,
        // so the launcher sees this rank fail first.
        let stats = self.setup.memory.check(self.ddp.step(
            window,
            &mut task::TaskMicroBatches {
                task: &mut *self.task,
                phases: &self.setup.memory,
                slow: self.slow,
            },
            &mut self.optimizer,
            lr,
            step,
        ))?;
        let step = step + 1;
        self.progress.step = step;
        self.setup.memory.set_step(step);
        self.progress.last_loss = Some(stats.loss);
        self.progress.time += stats.time;
        self.progress.data += self.task.take_data_time();
        self.progress.add_step(t0.elapsed().as_secs_f64());
        if let (Some(before), Some(after)) = (sent_before, self.ddp.comm().bytes_sent()) {
            *self.progress.sent.get_or_insert(0) += after.saturating_sub(before);
        }
        if self.term_launch_at == Some(step) {
            // Preemption, for tests: the launcher is told to stop, as Slurm would tell it.
            let _ = nix::sys::signal::kill(nix::unistd::getppid(), nix::sys::signal::SIGTERM);
            // Until launch has passed it on (at most 10 s): the stop then falls on the next
            // step however loaded the machine, and the test checks where it falls.
            if let Some(flag) = crate::preempt::flag() {
                let until = Instant::now() + Duration::from_secs(10);
                while !flag.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        self.log_step(epoch, lr, &stats, t0.elapsed().as_secs_f64())?;
        Ok(stats.stop_requested)
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
            trainer: self.eval.to_state(),
            ..self.start.clone()
        };
        let checkpoints = self.checkpoints();
        let ctx = self.slow_ctx(step);
        // Whole whatever the ZeRO stage (every rank gives its shard): one format for all.
        let optimizer_state = self.ddp.optimizer_state(&self.optimizer, ctx)?;
        save_checkpoint(
            &mut self.ddp,
            &mut self.saver,
            &optimizer_state,
            &checkpoints,
            state,
            self.setup.plan.config.checkpoint.keep as usize,
            ctx,
        )?;
        let path = checkpoints.join(runtime::checkpoint::step_dir_name(step));
        self.setup
            .memory
            .update(|f| f.last_checkpoint = Some(path.display().to_string()));
        Ok(())
    }

    /// After a checkpoint: when `launch` asked any rank to let the group re-form (SIGUSR1),
    /// every rank stops here together ([`TrainError::Regroup`]).
    fn regroup_if_asked(&mut self, step: u64) -> Result<(), TrainError> {
        let asked = f32::from(u8::from(crate::regroup::requested()));
        let mut flag = [tch::Tensor::from_slice(&[asked])];
        let ctx = self.ctx(step);
        self.ddp
            .comm()
            .all_reduce(&mut flag, runtime::collective::ReduceOp::Sum, ctx)?;
        if flag[0].f_double_value(&[0])? > 0.0 {
            // The re-formed group resumes from the checkpoint just made.
            self.checkpoints_on_disk(step)?;
            return Err(TrainError::Regroup { step });
        }
        Ok(())
    }

    /// Every rank waits until rank 0's checkpoints are on disk and learns whether they are.
    pub(super) fn checkpoints_on_disk(&mut self, step: u64) -> Result<(), TrainError> {
        let ctx = self.slow_ctx(step);
        sync::checkpoints_on_disk(&mut self.ddp, &mut self.saver, ctx)
    }

    /// Peak memory of every rank, and how the run went.
    fn report(mut self, tested: Vec<(Split, Metrics)>) -> Result<TrainReport, TrainError> {
        let (test, cold): (Vec<_>, Vec<_>) =
            tested.into_iter().partition(|(s, _)| *s == Split::Test);
        let test = test.into_iter().next().map(|(_, m)| m);
        let ctx = self.ctx(self.progress.step);
        let peak_rss = gather_u64(self.ddp.comm(), memory::peak_rss_bytes(), ctx)?;
        let peak_device = if self.device.is_cuda() {
            let peak = self.setup.memory.peak_bytes(self.device);
            Some(gather_u64(self.ddp.comm(), peak, ctx)?)
        } else {
            None
        };
        let (time, data, steps_run) = (
            self.progress.time,
            self.progress.data,
            self.progress.steps_run,
        );
        let rank_times = if steps_run > 0 {
            let mine = RankTime::per_step(time, data, steps_run);
            rank_time::gather(self.ddp.comm(), mine, ctx)?
        } else {
            Vec::new()
        };
        // Every rank's backend counts or none does (the same backend everywhere).
        let sent_per_step = match self.progress.sent {
            Some(sent) if steps_run > 0 => gather_u64(self.ddp.comm(), sent / steps_run, ctx)?,
            _ => Vec::new(),
        };
        let p = &self.progress;
        let global = self.setup.plan.batch.global;
        Ok(TrainReport {
            steps: p.step,
            epochs_done: p.epochs_done,
            last_loss: p.last_loss,
            resumed_from: self.resumed_from,
            best: self.eval.best,
            test,
            cold,
            stopped_early: self.eval.stopped_early,
            peak_rss,
            peak_device,
            samples_per_s: if p.steps_run > 0 {
                p.samples_per_s(global)
            } else {
                0.0
            },
            steady_samples_per_s: p.steady_samples_per_s(global),
            steady_rank_time: p.steady_rank_time(),
            seconds: Seconds {
                steps: p.step_secs,
                evaluation: p.eval_secs,
                checkpoints: p.checkpoint_secs,
                total: p.started.elapsed().as_secs_f64(),
            },
            seconds_per_epoch: (p.full_epochs > 0)
                .then(|| p.full_epoch_secs / p.full_epochs as f64),
            rank_times,
            sent_per_step,
            steps_run,
            earlier_summary: self.earlier_summary,
        })
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
        schedule: config.train.lr_schedule,
        min_lr: config.train.min_lr,
    }
}

/// The torch seed of optimizer step `step` on `rank`.
fn step_seed(seed: u64, step: u64, rank: usize) -> i64 {
    // SplitMix64's mix of the three, so nearby steps and ranks get unrelated streams.
    let x = seed
        ^ step.wrapping_mul(runtime::rng::GOLDEN)
        ^ (rank as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
    (runtime::rng::mix(x) >> 1) as i64
}

fn io(path: &Path, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}
