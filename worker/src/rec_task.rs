//! The recommender as the trainer's [`Task`]: `recommender::RecTask`'s loss and evaluation
//! behind the trainer's interface, and its errors as the trainer's.

use recommender::eval::Metrics;
use recommender::{RecError, RecTask, Split};
use tch::Tensor;

use crate::trainer::{Task, TrainError};
use runtime::collective::{Collective, OpContext};

impl Task for RecTask {
    fn train_len(&self) -> usize {
        RecTask::train_len(self)
    }

    fn begin_step(&mut self, step: u64) {
        RecTask::begin_step(self, step);
    }

    fn loss(&mut self, indices: &[usize]) -> Result<Tensor, tch::TchError> {
        RecTask::loss(self, indices)
    }

    fn finish_backward(&mut self) -> Result<(), tch::TchError> {
        RecTask::finish_backward(self)
    }

    /// Checkpointed GPT-2 blocks get their gradients in `finish_backward`'s recomputation.
    fn backward_is_whole(&self) -> bool {
        RecTask::checkpointed_blocks(self) == 0
    }

    fn take_data_time(&mut self) -> std::time::Duration {
        RecTask::take_data_time(self)
    }

    fn embedding_tables(&self) -> Vec<String> {
        RecTask::embedding_tables(self)
    }

    fn units(&self) -> Vec<String> {
        RecTask::units(self)
    }

    fn set_param_gate(&mut self, gate: runtime::ddp::ParamGate) {
        RecTask::set_param_gate(self, gate);
    }

    fn rows_used(&self, table: &str) -> Option<&[i64]> {
        RecTask::rows_used(self, table)
    }

    fn model_hash(&self) -> String {
        RecTask::model_hash(self)
    }

    fn test_splits(&self) -> Vec<Split> {
        RecTask::test_splits(self)
    }

    fn hold_evaluation_state(&mut self, hold: bool) {
        RecTask::hold_tables(self, hold);
    }

    fn evaluate(
        &mut self,
        split: Split,
        comm: &mut dyn Collective,
        ctx: OpContext,
    ) -> Result<Option<Metrics>, TrainError> {
        Ok(Some(RecTask::evaluate(self, split, comm, ctx)?))
    }
}

impl From<RecError> for TrainError {
    fn from(e: RecError) -> TrainError {
        match e {
            RecError::Collective(c) => TrainError::Collective(c),
            RecError::Torch(t) => TrainError::Torch(t),
            other => TrainError::Plan(other.to_string()),
        }
    }
}
