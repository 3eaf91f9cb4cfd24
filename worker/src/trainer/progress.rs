//! The run's counters as it goes (steps, epochs, time per phase) and the split of its wall time
//! into training steps, evaluations and checkpoints: what training samples/s divides by.
//! Must not: log, decide when to evaluate or save, or talk to other ranks.

use std::time::{Duration, Instant};

use super::{TrainError, Trainer};

/// Counters of the run as it goes.
#[derive(Debug)]
pub(super) struct Progress {
    pub(super) step: u64,
    pub(super) last_loss: Option<f64>,
    pub(super) epochs_done: u64,
    /// Steps and full epochs this process ran (not those of a run it resumed).
    pub(super) steps_run: u64,
    pub(super) full_epochs: u64,
    pub(super) full_epoch_secs: f64,
    pub(super) started: Instant,
    /// This rank's time in the parts of its steps, summed, and the data part of it.
    pub(super) time: runtime::ddp::StepTime,
    pub(super) data: Duration,
    /// Wall time of this run's optimizer steps (what training samples/s divides by), and of
    /// those after the first [`WARM_UP_STEPS`] (steady state).
    pub(super) step_secs: f64,
    pub(super) steady_secs: f64,
    /// Wall time of evaluations (validation and test) and of checkpoints (saving, the best
    /// model) in this run: reported beside the training figures, never inside them.
    pub(super) eval_secs: f64,
    pub(super) checkpoint_secs: f64,
    /// [`Progress::time`] and [`Progress::data`] when the warm-up steps were done.
    pub(super) warm: Option<(runtime::ddp::StepTime, Duration)>,
    /// Bytes this rank sent to the others during its steps (`None`: the backend does not
    /// count).
    pub(super) sent: Option<u64>,
}

/// Steps of a run that are not steady state (CUDA kernels chosen, the allocator's pools
/// grown, caches warm): left out of the steady-state samples/s.
pub const WARM_UP_STEPS: u64 = 3;

/// What a stretch of a run outside its steps was spent on ([`Trainer::timed`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Spent {
    Evaluation,
    Checkpoint,
}

/// Wall seconds of a run (this process), by what they were spent on.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Seconds {
    /// Optimizer steps (what training samples/s divides by).
    pub steps: f64,
    /// Validations and the final test evaluation.
    pub evaluation: f64,
    /// Saving checkpoints and the best model.
    pub checkpoints: f64,
    /// From the first step's start to the report (the rest: logging, regrouping checks).
    pub total: f64,
}

impl Progress {
    /// Nothing done yet; the clock starts now.
    pub(super) fn new() -> Progress {
        Progress {
            step: 0,
            last_loss: None,
            epochs_done: 0,
            steps_run: 0,
            full_epochs: 0,
            full_epoch_secs: 0.0,
            started: Instant::now(),
            time: Default::default(),
            data: Duration::ZERO,
            step_secs: 0.0,
            steady_secs: 0.0,
            eval_secs: 0.0,
            checkpoint_secs: 0.0,
            warm: None,
            sent: None,
        }
    }

    /// Training samples per second of this process's steps so far (`global` samples each),
    /// over the steps' own time: evaluations and checkpoints excluded, as Hugging Face's
    /// `train_samples_per_second`.
    pub(super) fn samples_per_s(&self, global: u64) -> f64 {
        (self.steps_run * global) as f64 / self.step_secs.max(1e-9)
    }

    /// [`Progress::samples_per_s`] after the first [`WARM_UP_STEPS`]; `None` before any.
    pub(super) fn steady_samples_per_s(&self, global: u64) -> Option<f64> {
        let steady = self
            .steps_run
            .checked_sub(WARM_UP_STEPS)
            .filter(|&n| n > 0)?;
        Some((steady * global) as f64 / self.steady_secs.max(1e-9))
    }

    /// One optimizer step of `secs` done (after [`Progress::time`] and [`Progress::data`]
    /// counted it).
    pub(super) fn add_step(&mut self, secs: f64) {
        self.steps_run += 1;
        self.step_secs += secs;
        if self.steps_run > WARM_UP_STEPS {
            self.steady_secs += secs;
        }
        if self.steps_run == WARM_UP_STEPS {
            self.warm = Some((self.time, self.data));
        }
    }

    /// This rank's time per phase of a step after the warm-up steps (`None` without any).
    pub(super) fn steady_rank_time(&self) -> Option<super::RankTime> {
        let (warm, warm_data) = self.warm?;
        let steps = self
            .steps_run
            .checked_sub(WARM_UP_STEPS)
            .filter(|&n| n > 0)?;
        let time = runtime::ddp::StepTime {
            compute: self.time.compute.saturating_sub(warm.compute),
            collective: self.time.collective.saturating_sub(warm.collective),
            update: self.time.update.saturating_sub(warm.update),
        };
        Some(super::RankTime::per_step(
            time,
            self.data.saturating_sub(warm_data),
            steps,
        ))
    }

    /// Seconds left until `total_steps` at this process's pace so far; `None` before a step.
    pub(super) fn eta_s(&self, total_steps: u64) -> Option<f64> {
        (self.steps_run > 0).then(|| {
            let per_step = self.started.elapsed().as_secs_f64() / self.steps_run as f64;
            per_step * total_steps.saturating_sub(self.step) as f64
        })
    }
}

impl Trainer<'_> {
    /// `work` on the trainer, its wall time counted as `spent`.
    pub(super) fn timed<T>(
        &mut self,
        spent: Spent,
        work: impl FnOnce(&mut Self) -> Result<T, TrainError>,
    ) -> Result<T, TrainError> {
        let started = Instant::now();
        let result = work(self);
        let secs = started.elapsed().as_secs_f64();
        match spent {
            Spent::Evaluation => self.progress.eval_secs += secs,
            Spent::Checkpoint => self.progress.checkpoint_secs += secs,
        }
        result
    }
}
