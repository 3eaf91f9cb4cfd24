//! What the trainer trains: a [`Task`] (a model plus a loss over sample indices, optionally an
//! evaluation) and the adapter that lets the DDP engine run it micro-batch by micro-batch.

use tch::Tensor;

use common::memory::{Phase, PhaseSink};
use dist::collective::{Collective, OpContext};
use dist::ddp::{MicroBatchLoss, StepPhase};
use recommender::eval::Metrics;
use recommender::Split;

use super::TrainError;

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
    /// Names of the variables that are embedding tables (few rows touched per step), whose
    /// gradients the engine may exchange row-sparse. Default: none.
    fn embedding_tables(&self) -> Vec<String> {
        Vec::new()
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

/// A task as the DDP engine runs it, micro-batch by micro-batch.
pub(super) struct TaskMicroBatches<'a> {
    pub(super) task: &'a mut dyn Task,
    pub(super) phases: &'a dyn PhaseSink,
}

impl MicroBatchLoss<Vec<usize>> for TaskMicroBatches<'_> {
    fn loss(&mut self, indices: &Vec<usize>) -> Result<Tensor, tch::TchError> {
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
}
