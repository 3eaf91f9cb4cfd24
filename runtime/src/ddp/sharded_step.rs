//! The engine's step when its parameters are sharded over one host's ranks
//! ([`super::DdpConfig::shard_optimizer`], memory and arithmetic in [`super::host_shards`]):
//! after the summary all-reduce, which every rank enters only once its gradients are complete,
//! each rank reduces its rows of every parameter where the gradients lie; a barrier; every rank
//! takes the clipping norm from the published row sums (the same bits on all); each clips and
//! updates its rows; a barrier ends the step. Two synchronisations instead of an all-reduce per
//! bucket, and no gradient is copied.

use std::time::Instant;

use super::{not_finite_norm, touched_rows, Ddp, DdpError, StepTime};
use crate::collective::OpContext;
use crate::optim::AdamW;

impl Ddp {
    /// Reduces, clips and updates this rank's rows of every parameter, from the reduced
    /// `summary` (which names each sparse table's touched rows); returns the gradient norm before
    /// clipping. With `check_due`, first counts the rows each sparse table's gradient touched
    /// that the model did not report (the parameter check reports them). Adds to `time`.
    pub(super) fn sharded_update(
        &mut self,
        summary: &[f32],
        check_due: bool,
        optimizer: &mut AdamW,
        lr: f64,
        ctx: OpContext,
        time: &mut StepTime,
    ) -> Result<f64, DdpError> {
        let updating = Instant::now();
        let unions = self.unions(summary);
        if check_due {
            self.left_out = self.rows_left_out(&unions)?;
        }
        for (table, union) in self.sparse.iter_mut().zip(unions) {
            table.union = union;
        }
        let rank = self.rank();
        let shards = self.shards.as_ref().ok_or_else(not_sharded)?;
        for i in 0..self.params.len() {
            shards.reduce(i, self.listed(i), rank);
        }
        time.update += updating.elapsed();
        let waiting = Instant::now();
        self.comm.barrier(ctx)?; // every row's sum of squares is published
        time.collective += waiting.elapsed();

        let updating = Instant::now();
        let shards = self.shards.as_ref().ok_or_else(not_sharded)?;
        let mut sum = 0.0;
        for i in 0..self.params.len() {
            sum += shards.sum_of_squares(i, self.listed(i))?;
        }
        let grad_norm: f64 = sum.sqrt();
        if !grad_norm.is_finite() {
            // The same on every rank (from the same row sums): all stop together.
            return Err(not_finite_norm(ctx.step, grad_norm));
        }
        // As `clip::clip_grads` scales, on our rows.
        let coef = self.config.max_grad_norm / (grad_norm + 1e-6);
        if coef < 1.0 {
            for (i, p) in self.params.iter().enumerate() {
                shards.scale(i, &p.grad(), self.listed(i), coef)?;
            }
        }
        shards.attach(optimizer)?;
        optimizer.step(&self.params, lr);
        time.update += updating.elapsed();
        let waiting = Instant::now();
        self.comm.barrier(ctx)?; // every row is updated before anyone reads it
        time.collective += waiting.elapsed();
        Ok(grad_norm)
    }

    /// The rows parameter `index` exchanges this step: a sparse table's touched ones (when the
    /// exchange is row-sparse), all of any other.
    pub(super) fn listed(&self, index: usize) -> Option<&[i64]> {
        self.sparse
            .iter()
            .find(|t| t.index == index)
            .and_then(|t| t.union.as_deref())
    }

    /// Per sparse table, how many rows this rank's gradient touched outside `unions` (the rows
    /// every rank reported): rows left out of the reduction, which a model that under-reports
    /// its rows causes (shared parameters cannot drift apart, so this is what can be checked).
    fn rows_left_out(&self, unions: &[Option<Vec<i64>>]) -> Result<Vec<u64>, DdpError> {
        let mut counts = Vec::with_capacity(self.sparse.len());
        for (table, union) in self.sparse.iter().zip(unions) {
            let Some(union) = union else {
                counts.push(0); // the whole table is reduced
                continue;
            };
            let touched = touched_rows(&self.params[table.index].grad())?;
            let outside = (0..table.rows)
                .filter(|r| touched[*r as usize] > 0.0 && union.binary_search(r).is_err())
                .count();
            counts.push(outside as u64);
        }
        Ok(counts)
    }
}

fn not_sharded() -> DdpError {
    DdpError::Loss {
        step: 0,
        detail: "internal error: a sharded step without shared parameters".into(),
    }
}
