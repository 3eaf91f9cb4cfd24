//! The gradients before a step: zeroed, dense where the reduction needs them dense, and
//! under ZeRO stages 2 and 3 left for autograd to make where only their shards are kept. Must
//! not: reduce or update anything.

use tch::Tensor;

use super::{param_storage, rows, Ddp, DdpError};

impl Ddp {
    /// Zeroes every gradient before a step (giving dense ones first): a sparse table whose last
    /// exchange was row-sparse only on the rows it exchanged, the only ones not zero (a whole
    /// table is most of a step's memory traffic otherwise). Under ZeRO stage 2 the buckets'
    /// parameters have none (their shards were kept, the gradients dropped): autograd makes
    /// them in backward.
    pub(super) fn zero_grads(&mut self) -> Result<(), DdpError> {
        if let Some(zero) = self.zero.as_ref().filter(|z| z.stage() >= 2) {
            // Whatever gave them one (the set-up, a window that failed): autograd makes them.
            zero.drop_bucket_grads(&self.params)?;
        }
        self.give_dense_grads()?;
        let mut done = vec![false; self.params.len()];
        for table in &mut self.sparse {
            table.used = Some(vec![0.0; table.rows as usize]);
            // Taken: until this step's exchange, nothing says which rows are non-zero.
            if let Some(union) = table.union.take() {
                rows::zero(&self.params[table.index].grad(), &union)?;
                done[table.index] = true;
            }
        }
        for (p, done) in self.params.iter_mut().zip(done) {
            if !done {
                p.zero_grad();
            }
        }
        Ok(())
    }

    /// [`give_dense_grads`] to the parameters, but under ZeRO stages 2 and 3 without
    /// accumulation to those outside the buckets only: the buckets' gradients are made by
    /// autograd in backward and dropped once their shards are kept (a zero gradient given here
    /// would be a whole one more at the first step's peak). With accumulation they get one too,
    /// as DDP's do: the micro-batches keep whole gradients anyway, and a row-sparse backward
    /// must add into a dense gradient in DDP's order (sparse ones summed later would add a
    /// row's parts in another order, other bits).
    pub(super) fn give_dense_grads(&self) -> Result<(), DdpError> {
        let accumulating = self.config.grad_accum > 1;
        if let (Some(zero), true) = (self.zero.as_ref().filter(|z| z.stage() == 3), accumulating) {
            // Stage 3's values may be released: a zero gradient from the shape alone.
            let (mut buckets, mut others) = (Vec::new(), Vec::new());
            for (i, p) in self.params.iter().enumerate() {
                match zero.in_bucket(i) {
                    true => buckets.push(p),
                    false => others.push(p.shallow_clone()),
                }
            }
            buckets
                .into_iter()
                .try_for_each(param_storage::give_zero_grad)?;
            give_dense_grads(&others)?;
            return Ok(());
        }
        match (self.zero.as_ref()).filter(|z| z.stage() >= 2 && !accumulating) {
            Some(zero) => {
                let others: Vec<Tensor> = (self.params.iter().enumerate())
                    .filter(|(i, _)| !zero.in_bucket(*i))
                    .map(|(_, p)| p.shallow_clone())
                    .collect();
                give_dense_grads(&others)?;
            }
            None => give_dense_grads(&self.params)?,
        }
        Ok(())
    }
}

/// Gives each of `params` that has no gradient yet a dense zero one. An embedding whose
/// backward is sparse (`sparse = true`: a few rows instead of a dense table per micro-batch)
/// then adds into it in place and the gradient stays dense, as the reduction and the optimizer
/// need; left undefined, the first backward would store a sparse gradient instead. Refuses a
/// gradient that is already sparse (it cannot be replaced).
pub fn give_dense_grads(params: &[Tensor]) -> Result<(), tch::TchError> {
    for p in params {
        let grad = p.grad();
        if grad.defined() && grad.is_sparse() {
            return Err(tch::TchError::Torch(format!(
                "a parameter of shape {:?} has a sparse gradient: give it a dense one (runtime::ddp::give_dense_grads) before its first backward",
                p.size()
            )));
        }
        if !grad.defined() && p.requires_grad() {
            tch::with_grad(|| (p.f_sum(tch::Kind::Float)? * 0.0).f_backward())?;
        }
    }
    Ok(())
}
