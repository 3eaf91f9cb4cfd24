//! What the trainer trains: a [`Task`] (a model plus a loss over sample indices, optionally an
//! evaluation) and the adapter that lets the DDP engine run it micro-batch by micro-batch.

use tch::Tensor;

use common::memory::{Phase, PhaseSink};
use recommender::eval::Metrics;
use recommender::Split;
use runtime::collective::{Collective, OpContext};
use runtime::ddp::{MicroBatchLoss, StepPhase};

use super::TrainError;

/// What the engine trains: a model (its variables live in a `VarStore`) and a loss.
pub trait Task {
    /// Number of training samples (the sampler shards `0..train_len()`).
    fn train_len(&self) -> usize;
    /// The optimizer step the coming micro-batches belong to, the same on every rank: what a
    /// task draws once for the whole step (shared negatives) comes from it. Default: nothing.
    fn begin_step(&mut self, _step: u64) {}
    /// Mean loss over the samples `indices` (one micro-batch), ready for backward.
    fn loss(&mut self, indices: &[usize]) -> Result<Tensor, tch::TchError>;
    /// Completes the backward pass after `loss(..).backward()` (activation checkpointing
    /// recomputes here). Default: nothing to do.
    fn finish_backward(&mut self) -> Result<(), tch::TchError> {
        Ok(())
    }
    /// Whether `loss(..).backward()` alone gives the gradients their final values
    /// (`finish_backward` adds to none), so that the engine may all-reduce them during
    /// backward (`dist.overlap_backward`). Default: true (nothing left to finish).
    fn backward_is_whole(&self) -> bool {
        true
    }
    /// Time spent assembling micro-batches since the last call (part of what the engine
    /// counts as compute; the per-rank timing shows it apart). Default: not measured (zero).
    fn take_data_time(&mut self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
    /// The model's units for ZeRO stage 3 (`runtime::ddp::DdpConfig::units`): variable-name
    /// prefixes in forward order, each gathered around its use. Default: none.
    fn units(&self) -> Vec<String> {
        Vec::new()
    }
    /// Receives ZeRO stage 3's gate, through which the model gathers its units. Default: the
    /// task has no units.
    fn set_param_gate(&mut self, _gate: runtime::ddp::ParamGate) {}
    /// Names of the variables that are embedding tables (few rows touched per step), whose
    /// gradients the engine may exchange row-sparse. Default: none.
    fn embedding_tables(&self) -> Vec<String> {
        Vec::new()
    }
    /// The rows of embedding table `table` the last micro-batch's loss looked up (a superset of
    /// those its gradient touched), or `None` when the task cannot tell. Default: `None`.
    fn rows_used(&self, _table: &str) -> Option<&[i64]> {
        None
    }
    /// A fingerprint of the model's configuration, optionally followed by `+` and one of the
    /// data it trains on; a checkpoint of another model (or trained on other data) is refused.
    fn model_hash(&self) -> String;
    /// What the best model is tested on at the end, in order. Default: `test`.
    fn test_splits(&self) -> Vec<Split> {
        vec![Split::Test]
    }
    /// While `hold` (until called again with `false`), the evaluations may reuse what the first
    /// one computed from the parameters (the trainer does not change them meanwhile). Default:
    /// nothing held.
    fn hold_evaluation_state(&mut self, _hold: bool) {}
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

/// A task as the DDP engine runs it, micro-batch by micro-batch.
pub(super) struct TaskMicroBatches<'a> {
    pub(super) task: &'a mut dyn Task,
    pub(super) phases: &'a dyn PhaseSink,
    /// `GPTREC_FAULT_SLOW`: extra time this rank spends on each micro-batch.
    pub(super) slow: Option<std::time::Duration>,
}

impl MicroBatchLoss<Vec<usize>> for TaskMicroBatches<'_> {
    fn loss(&mut self, indices: &Vec<usize>) -> Result<Tensor, tch::TchError> {
        if let Some(delay) = self.slow {
            std::thread::sleep(delay);
        }
        self.task.loss(indices)
    }

    /// The engine's phase is the out-of-memory report's phase.
    fn phase(&mut self, phase: StepPhase) {
        self.phases.enter(match phase {
            StepPhase::Forward => Phase::Forward,
            StepPhase::Backward => Phase::Backward,
            StepPhase::Optimizer => Phase::Optimizer,
        });
    }

    fn finish_backward(&mut self) -> Result<(), tch::TchError> {
        self.task.finish_backward()
    }

    fn backward_is_whole(&self) -> bool {
        self.task.backward_is_whole()
    }

    fn rows_used(&self, table: &str) -> Option<&[i64]> {
        self.task.rows_used(table)
    }
}

/// `GPTREC_FAULT_SLOW=MS[@RANK]`: makes `rank` (every rank when absent) spend `MS` more
/// milliseconds on each micro-batch, a straggler for tests. `None` when unset or for another
/// rank.
pub(super) fn slow_fault(text: &str, rank: usize) -> Result<Option<std::time::Duration>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let bad = || format!("GPTREC_FAULT_SLOW={text}: expected MS or MS@RANK (whole numbers)");
    let (ms, only) = match text.split_once('@') {
        Some((ms, r)) => (ms, Some(r.parse::<usize>().map_err(|_| bad())?)),
        None => (text, None),
    };
    let ms: u64 = ms.parse().map_err(|_| bad())?;
    Ok((only.is_none_or(|r| r == rank)).then(|| std::time::Duration::from_millis(ms)))
}

/// `GPTREC_FAULT_STOP=STEP@RANK`: `rank` stops itself with SIGSTOP before optimizer step `STEP`
/// (counted from 1, as the log and errors count them), a hung peer for tests. `None` when unset
/// or for another rank.
pub(super) fn stop_fault(text: &str, rank: usize) -> Result<Option<u64>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let bad = || format!("GPTREC_FAULT_STOP={text}: expected STEP@RANK (whole numbers)");
    let (step, only) = text.split_once('@').ok_or_else(bad)?;
    let step: u64 = step.parse().map_err(|_| bad())?;
    let only: usize = only.parse().map_err(|_| bad())?;
    Ok((only == rank).then_some(step))
}

#[cfg(test)]
mod tests {
    use super::{slow_fault, stop_fault};

    #[test]
    fn stop_fault_parses_step_and_rank() {
        assert_eq!(stop_fault("", 1), Ok(None));
        assert_eq!(stop_fault("5@1", 1), Ok(Some(5)));
        assert_eq!(stop_fault("5@1", 0), Ok(None));
        for bad in ["5", "x@1", "5@", "-1@0"] {
            assert!(
                stop_fault(bad, 0).unwrap_err().contains("STEP@RANK"),
                "{bad}"
            );
        }
    }
    use std::time::Duration;

    #[test]
    fn slow_fault_parses_ms_and_rank() {
        assert_eq!(slow_fault("", 0), Ok(None));
        assert_eq!(slow_fault("30", 2), Ok(Some(Duration::from_millis(30))));
        assert_eq!(slow_fault("30@1", 1), Ok(Some(Duration::from_millis(30))));
        assert_eq!(slow_fault("30@1", 0), Ok(None));
        for bad in ["x", "30@", "@1", "-5", "3.5"] {
            assert!(slow_fault(bad, 0).unwrap_err().contains("MS@RANK"), "{bad}");
        }
    }
}
