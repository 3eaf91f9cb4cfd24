//! The evaluation cadence of a run: validation every `eval.every_n_epochs` with the best model
//! kept in `<run dir>/best/` and early stopping on `eval.metric`, and the test evaluation of the
//! best model at the end.

use std::time::Instant;

use super::{
    broadcast_json, eval_record, resume, save_linked, BestRecord, Split, TrainError, Trainer,
};
use common::memory::{Phase, PhaseSink as _};
use recommender::eval::Metrics;
use runtime::checkpoint;

impl Trainer<'_> {
    /// Validation every `eval.every_n_epochs` (and after the last epoch), before the epoch's
    /// checkpoint so that it knows the best so far.
    pub(super) fn validate_if_due(&mut self) -> Result<(), TrainError> {
        let done = self.progress.epochs_done;
        let every = u64::from(self.setup.plan.config.eval.every_n_epochs);
        if done % every != 0 && done != self.epochs {
            return Ok(());
        }
        let t0 = Instant::now();
        self.report_progress(common::progress::Phase::Evaluate, true);
        self.setup.memory.enter(Phase::Evaluation);
        let ctx = self.slow_ctx(self.progress.step);
        // Under ZeRO stage 3 the evaluation reads every parameter whole (until the next step).
        self.ddp.gather_params()?;
        let valid = self.task.evaluate(Split::Valid, self.ddp.comm(), ctx);
        let Some(m) = self.setup.memory.check(valid)? else {
            return Ok(());
        };
        let secs = t0.elapsed().as_secs_f64();
        let step = self.progress.step;
        if let Some(file) = self.metrics.as_mut() {
            file.append(&eval_record("valid", done, step, &m, secs))?;
        }
        let value = m.get(&self.metric).unwrap_or(f64::NAN);
        if self.eval.best.as_ref().is_none_or(|b| value > b.value) {
            self.new_best(m, value, secs);
        } else {
            self.no_improvement(&m, value, secs);
        }
        Ok(())
    }

    /// Records a new best model; [`Trainer::save_best`] saves it once its epoch's checkpoint is
    /// saved (its model file a link to that checkpoint's: nothing written twice).
    pub(super) fn new_best(&mut self, m: Metrics, value: f64, secs: f64) {
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
        self.best_to_save = Some(step);
        let was = previous.map_or(String::new(), |p| {
            format!(", was {:.4} at epoch {}", p.value, p.epoch)
        });
        self.say(format!("{line} — new best {} {value:.4}{was}", self.metric));
    }

    /// The best model found at `step`, if any, into `<run dir>/best/`, its model file a link to
    /// the checkpoint of `step` (saved just before, which records it as the best).
    pub(super) fn save_best(&mut self, step: u64) -> Result<(), TrainError> {
        let Some(best) = self.best_to_save.take() else {
            return Ok(());
        };
        let from = self.checkpoints().join(checkpoint::step_dir_name(best));
        let best_dir = self.setup.run_dir.join("best");
        let ctx = self.slow_ctx(step);
        save_linked(&mut self.ddp, &mut self.saver, &best_dir, &from, best, ctx)?;
        self.best_saved_at = Some(best);
        Ok(())
    }

    /// Counts an evaluation without improvement; stops early when patience runs out.
    pub(super) fn no_improvement(&mut self, m: &Metrics, value: f64, secs: f64) {
        let done = self.progress.epochs_done;
        self.eval.evals_since_best += 1;
        let patience = self.setup.plan.config.eval.patience;
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

    /// The test evaluations of the best model (rank 0 reads it, everyone receives it): every
    /// split of [`Task::test_splits`](super::Task::test_splits), in its order, each recorded in
    /// `metrics.jsonl`; none when the run was interrupted by the test hook.
    pub(super) fn test(&mut self) -> Result<Vec<(Split, Metrics)>, TrainError> {
        let done = self.progress.epochs_done;
        let interrupted = self
            .setup
            .stop_after_epoch
            .is_some_and(|e| done == e && e < self.epochs && !self.eval.stopped_early);
        if interrupted {
            return Ok(Vec::new());
        }
        let step = self.progress.step;
        self.report_progress(common::progress::Phase::Evaluate, true);
        // The best model is read back (once on disk) unless it is what the parameters hold.
        if self.eval.best.is_some() && self.best_saved_at != Some(step) {
            self.checkpoints_on_disk(step)?;
            self.load_best(step)?;
        }
        // The splits are evaluated with the same parameters: what they share is computed once.
        self.task.hold_evaluation_state(true);
        let tested = self.test_splits(step, done);
        self.task.hold_evaluation_state(false);
        tested
    }

    /// Every split of [`Task::test_splits`](super::Task::test_splits), each recorded.
    fn test_splits(&mut self, step: u64, done: u64) -> Result<Vec<(Split, Metrics)>, TrainError> {
        let mut results = Vec::new();
        for split in self.task.test_splits() {
            let t0 = Instant::now();
            self.setup.memory.enter(Phase::Evaluation);
            let ctx = self.slow_ctx(step);
            self.ddp.gather_params()?;
            let metrics = self.task.evaluate(split, self.ddp.comm(), ctx);
            let Some(m) = self.setup.memory.check(metrics)? else {
                continue;
            };
            if let Some(file) = self.metrics.as_mut() {
                let epoch = self.eval.best.as_ref().map_or(done, |b| b.epoch);
                let secs = t0.elapsed().as_secs_f64();
                file.append(&eval_record(split.name(), epoch, step, &m, secs))?;
            }
            results.push((split, m));
        }
        Ok(results)
    }

    pub(super) fn load_best(&mut self, step: u64) -> Result<(), TrainError> {
        // Rank 0 loads into whole parameters (ZeRO stage 3 keeps shards between steps).
        self.ddp.gather_params()?;
        let leader = self.leader();
        let failure = if leader {
            resume::load_best(
                &self.ddp.named_variables(),
                &self.setup.run_dir.join("best"),
                None,
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
}
