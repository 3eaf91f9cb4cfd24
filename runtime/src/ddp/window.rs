//! The micro-batches of one optimizer step's window, on the training thread: forward and
//! backward of each (the loss divided by the window's length, gradients accumulating), the
//! rows each used marked for the row-sparse exchange, and the hook for the last backward pass
//! (where overlap arms its gradient hooks). Must not: reduce anything across ranks or touch the
//! optimizer (the engine does, after the window).

use tch::{Kind, Tensor};

use super::{DdpError, MicroBatchLoss, SparseTable, StepPhase};

/// This rank's share of a window's loss: the micro-batches' losses / window length, summed in
/// f64 where they were computed (read with the step's summary, not one by one: each read would
/// be a host wait). Not finite when any of them was not.
pub(super) struct WindowLoss {
    pub(super) local: Tensor,
}

/// Forward and backward of each micro-batch of `window` (loss / window length, gradients
/// accumulating), marking the rows each used in `sparse`; `before_last_backward` runs just
/// before the last backward pass with the model's [`MicroBatchLoss::backward_is_whole`]. A loss
/// that is not finite is found by the step's summary, after the window (the update is then
/// refused on every rank).
pub(super) fn micro_batches<B>(
    window: &[B],
    model: &mut impl MicroBatchLoss<B>,
    sparse: &mut [SparseTable],
    before_last_backward: impl FnOnce(bool),
) -> Result<WindowLoss, DdpError> {
    let scale = 1.0 / window.len() as f64;
    let mut before_last_backward = Some(before_last_backward);
    let mut local: Option<Tensor> = None;
    for (k, micro) in window.iter().enumerate() {
        model.phase(StepPhase::Forward);
        let loss = model.loss(micro)?;
        // As `value as f64 * scale` summed on the host was: the same f64 arithmetic.
        let share = loss
            .f_detach()?
            .f_to_kind(Kind::Double)?
            .f_mul_scalar(scale)?;
        local = Some(match local {
            None => share,
            Some(sum) => sum.f_add(&share)?,
        });
        model.phase(StepPhase::Backward);
        if k + 1 == window.len() {
            if let Some(arm) = before_last_backward.take() {
                arm(model.backward_is_whole());
            }
        }
        (loss * scale).f_backward()?;
        model.finish_backward()?;
        mark_rows_used(sparse, model);
    }
    let local = match local {
        Some(sum) => sum,
        None => Tensor::f_zeros([], (Kind::Double, tch::Device::Cpu))?,
    };
    Ok(WindowLoss { local })
}

/// Adds the rows the last micro-batch used to each sparse table's mask (`used` is set to all
/// zeros when the step's zeroing starts, and dropped for good once the model cannot tell).
fn mark_rows_used<B>(sparse: &mut [SparseTable], model: &impl MicroBatchLoss<B>) {
    for table in sparse {
        let Some(used) = table.used.as_mut() else {
            continue;
        };
        let rows = model.rows_used(&table.name);
        let fits = |r: &i64| (0..table.rows).contains(r);
        match rows {
            Some(rows) if rows.iter().all(fits) => {
                for &r in rows {
                    used[r as usize] = 1.0;
                }
            }
            _ => table.used = None,
        }
    }
}
