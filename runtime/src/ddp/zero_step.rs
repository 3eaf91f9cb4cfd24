//! The ZeRO step on the engine ([`super::zero`] holds the layout and the exchanges): the
//! optimizer that keeps this rank's shard, its state gathered for a checkpoint, and the
//! reduction, clipping, update and gathering after the step's summary. Must not: decide where
//! shards lie (the layout does) or touch the row-sparse tables beyond what DDP does to them.

use std::time::Instant;

use tch::Tensor;

use super::zero::ZeroLayout;
use super::{not_finite_norm, Ddp, DdpError, StepTime};
use crate::clip::{add_rows, sum_of_squares, ClipGrad};
use crate::collective::OpContext;
use crate::optim::AdamW;

impl Ddp {
    /// An AdamW for this engine's parameters: under ZeRO, holding moments for this rank's
    /// shard of the dense parameters only; with [`super::DdpConfig::offload`], in host memory.
    pub fn optimizer(&self, beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> AdamW {
        let elements = match &self.zero {
            Some(zero) => zero.elements().to_vec(),
            None => vec![None; self.params.len()],
        };
        let (params, wd) = (&self.params, weight_decay);
        match self.offloads() {
            true => AdamW::on_host(params, elements, beta1, beta2, eps, wd),
            false => AdamW::with_elements(params, elements, beta1, beta2, eps, wd),
        }
    }

    /// The optimizer state for a checkpoint (rank 0 saves it), whole whatever the stage: the
    /// format does not depend on it, so any world size and stage can resume it. Under ZeRO
    /// every rank must call it at the same point (the moments' shards are gathered to rank 0),
    /// and the other ranks get their shards only.
    pub fn optimizer_state(
        &mut self,
        optimizer: &AdamW,
        ctx: OpContext,
    ) -> Result<Vec<(String, Tensor)>, DdpError> {
        let mut state = optimizer.state_tensors();
        if let Some(zero) = &self.zero {
            let _guard = tch::no_grad_guard();
            zero.gather_moments(self.comm.as_mut(), &self.params, &mut state, ctx)?;
        }
        Ok(state)
    }

    /// The ZeRO stage in effect: the one [`super::DdpConfig::zero`] asked for where it applies
    /// (several ranks, not sharded through shared memory), else 0.
    pub fn zero_stage(&self) -> u8 {
        self.zero.as_ref().map_or(0, |z| z.stage())
    }

    /// ZeRO's reduction, clipping and update, after the summary (`summary` names the
    /// sparse tables' touched rows); returns the gradient norm before clipping.
    pub(super) fn zero_update(
        &mut self,
        summary: &[f32],
        optimizer: &mut AdamW,
        lr: f64,
        ctx: OpContext,
        time: &mut StepTime,
    ) -> Result<f64, DdpError> {
        let zero = (self.zero.clone())
            .ok_or_else(|| DdpError::Internal("a ZeRO step without its layout".into()))?;
        let made_here = zero.elements();
        match (0..self.params.len()).all(|i| optimizer.elements_kept(i) == made_here[i]) {
            true => self.zero_update_with(&zero, summary, optimizer, lr, ctx, time),
            false => Err(DdpError::Internal(
                "under ZeRO the optimizer must come from Ddp::optimizer (it keeps this rank's shard)".into(),
            )),
        }
    }

    fn zero_update_with(
        &mut self,
        zero: &ZeroLayout,
        summary: &[f32],
        optimizer: &mut AdamW,
        lr: f64,
        ctx: OpContext,
        time: &mut StepTime,
    ) -> Result<f64, DdpError> {
        let reducing = Instant::now();
        self.reduce_sparse(summary, ctx)?;
        let reduced = match &self.gate {
            Some(_) => self.reduced_in_backward,
            None => self.overlap.is_some(),
        };
        if !reduced {
            zero.reduce_scatter(self.comm.as_mut(), &self.params, ctx)?;
        }
        let rows = zero.all_row_sums(self.comm.as_mut(), &self.params, ctx)?;
        time.collective += reducing.elapsed();

        let updating = Instant::now();
        let grad_norm = self.zero_norm(&rows)?;
        if !grad_norm.is_finite() {
            // The same on every rank (from the same row sums): all stop together.
            return Err(not_finite_norm(ctx.step, grad_norm));
        }
        // As `clip::clip_grads` scales: the sparse tables whole (or by rows), our elements of
        // the rest (the only ones the update reads).
        let coef = self.config.max_grad_norm / (grad_norm + 1e-6);
        if coef < 1.0 {
            for (i, p) in self.params.iter().enumerate() {
                let grad = p.grad();
                match (optimizer.elements_kept(i), self.listed(i)) {
                    (Some(e), _) if e.is_empty() => {}
                    (Some(e), _) => {
                        let _ = zero.grad_span(&self.params, i, e)?.f_mul_scalar_(coef)?;
                    }
                    (None, Some(rows)) => crate::rows::scale(&grad, rows, coef)?,
                    (None, None) => {
                        let _ = grad.shallow_clone().f_mul_scalar_(coef)?;
                    }
                }
            }
        }
        // Row-sparse tables kept once per host: each rank updates its rows there, as without
        // ZeRO, and nobody reads them before all have (the barrier below).
        if let Some(shared) = &self.shared {
            shared.attach(optimizer)?;
        }
        let (grads, values) = (zero.own_grads(&self.params)?, zero.own_values()?);
        optimizer.step_parts(&self.params, lr, &grads, &values);
        time.update += updating.elapsed();
        let gathering = Instant::now();
        // Stage 3 keeps the updated shards: each unit is gathered where it is used next.
        if zero.stage() < 3 {
            zero.all_gather_params(self.comm.as_mut(), &self.params, ctx)?;
        }
        if self.shared.is_some() {
            self.comm.barrier(ctx)?;
        }
        time.collective += gathering.elapsed();
        Ok(grad_norm)
    }

    /// The global norm as `clip::clip_grads` takes it: each parameter's sum of squares in
    /// parameter order, a dense one's from its gathered row sums.
    fn zero_norm(&self, rows: &[Option<Vec<f64>>]) -> Result<f64, DdpError> {
        let mut sum = 0.0;
        for (i, p) in self.params.iter().enumerate() {
            let grad = p.grad();
            // A dense parameter counts by its row sums (stage 2 has dropped its gradient).
            if !grad.defined() && rows[i].is_none() {
                continue;
            }
            sum += match &rows[i] {
                Some(_) if p.numel() == 0 => 0.0,
                Some(sums) => add_rows(sums.len() as i64, None, |r| sums[r])?,
                None => sum_of_squares(&ClipGrad {
                    grad,
                    rows: self.listed(i),
                })?,
            };
        }
        Ok(sum.sqrt())
    }
}
