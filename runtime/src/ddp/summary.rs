//! The step's summary: the one small all-reduce that opens every optimizer step, with each
//! rank's loss, a "bad loss" flag, a "stop requested" flag, the straggler probe's slots and each row-sparse table's
//! touched-row mask; and how the reduced summary is read (the union of touched rows, the
//! slowest rank). Must not: reduce gradients or step the optimizer (the engine does).

use tch::{Kind, Tensor};

use super::{Ddp, DdpError, WindowLoss};

impl Ddp {
    /// `[local loss, bad-loss flag, stop flag, probe slot of each rank (with a probe),
    /// touched-row mask of each sparse table...]` (f32), where the loss was computed: its first
    /// two slots are filled there, from the loss, without reading it.
    pub(super) fn summary(&mut self, losses: &WindowLoss) -> Result<Tensor, DdpError> {
        // One buffer, one tensor: a tensor per part and their concatenation were a tenth of a
        // small model's update.
        let rows: usize = self.sparse.iter().map(|t| t.rows as usize).sum();
        let mut values = Vec::with_capacity(self.summary_head_len() as usize + rows);
        let stop =
            (self.stop_flag.as_ref()).is_some_and(|f| f.load(std::sync::atomic::Ordering::Relaxed));
        values.extend([0.0, 0.0, f32::from(u8::from(stop))]);
        if let Some(probe) = self.probe.as_mut() {
            let at = values.len() + self.comm.rank();
            values.resize(values.len() + self.comm.world_size(), 0.0);
            values[at] = probe() as f32;
        }
        for table in &mut self.sparse {
            match table.used.take() {
                Some(used) => values.extend_from_slice(&used),
                None => values.extend(touched_rows(&self.params[table.index].grad())?),
            }
        }
        let loss = &losses.local;
        let head = Tensor::f_stack(
            &[
                loss.f_to_kind(Kind::Float)?,
                loss.f_isfinite()?.f_logical_not()?.f_to_kind(Kind::Float)?,
            ],
            0,
        )?;
        let rest = Tensor::from_slice(&values[2..]);
        let device = loss.device();
        if device == tch::Device::Cpu {
            let summary = Tensor::from_slice(&values);
            summary.f_narrow(0, 0, 2)?.f_copy_(&head)?;
            return Ok(summary);
        }
        Ok(Tensor::f_cat(
            &[head, crate::host_read::to_device(&rest, device)],
            0,
        )?)
    }

    /// Per sparse table (in `sparse`'s order), from the reduced `summary`: the rows some rank
    /// touched (ascending), when they are at most half the table; `None` (the whole table)
    /// otherwise.
    pub(super) fn unions(&self, summary: &[f32]) -> Vec<Option<Vec<i64>>> {
        let mut masks = &summary[self.summary_head_len() as usize..];
        let mut unions = Vec::with_capacity(self.sparse.len());
        for table in &self.sparse {
            let (mask, rest) = masks.split_at(table.rows as usize);
            masks = rest;
            let union = rows_set(mask);
            unions.push((union.len() as i64 * 2 <= table.rows).then_some(union));
        }
        unions
    }

    /// Where the sparse tables' masks start in the summary.
    fn summary_head_len(&self) -> i64 {
        3 + if self.probe.is_some() {
            self.comm.world_size() as i64
        } else {
            0
        }
    }

    /// The largest probe slot of the reduced `summary`, with its rank (the lowest on a tie).
    pub(super) fn probed_max(&self, summary: &[f32]) -> Option<(usize, f64)> {
        self.probe.as_ref()?;
        let world = self.comm.world_size();
        summary.get(3..3 + world)?.iter().enumerate().fold(
            None,
            |best: Option<(usize, f64)>, (r, &v)| match best {
                Some((_, b)) if b >= f64::from(v) => best,
                _ => Some((r, f64::from(v))),
            },
        )
    }
}

/// 1.0 for each row of the 2-D `grad` that holds a non-zero (or NaN) element, 0.0 for the
/// others (f32). On a contiguous f32 CPU gradient one read pass with no temporaries (tensor
/// ops took five times as long, the largest part of the sparse exchange's cost); tensor ops
/// otherwise.
pub(super) fn touched_rows(grad: &Tensor) -> Result<Vec<f32>, tch::TchError> {
    let (rows, n) = (grad.size()[0], grad.numel());
    let cpu_f32 = grad.device() == tch::Device::Cpu && grad.kind() == tch::Kind::Float;
    if !cpu_f32 || !grad.is_contiguous() || n == 0 {
        let mask = grad
            .f_ne(0.0)?
            .f_any_dim(1, false)?
            .f_to_kind(tch::Kind::Float)?;
        return crate::host_read::f32s(&mask);
    }
    // SAFETY: a contiguous f32 CPU buffer of n elements, alive and unchanged for this call
    // (the step runs on the training thread, under no_grad).
    let values = unsafe { std::slice::from_raw_parts(grad.data_ptr() as *const f32, n) };
    let width = n / rows as usize;
    Ok(values
        .chunks_exact(width)
        // The bits but the sign's: zero only for ±0.0. A fold without early exit vectorises.
        .map(|row| {
            f32::from(u8::from(
                row.iter().fold(0, |acc, x| acc | x.to_bits() << 1) != 0,
            ))
        })
        .collect())
}

/// The indices of the positive entries of `mask`, ascending. Without a branch per entry: whether
/// a row was touched is a coin toss the branch predictor loses (that cost 4 ns a row).
pub(super) fn rows_set(mask: &[f32]) -> Vec<i64> {
    let mut rows = vec![0i64; mask.len()];
    let mut k = 0;
    for (r, m) in mask.iter().enumerate() {
        rows[k] = r as i64;
        k += usize::from(*m > 0.0);
    }
    rows.truncate(k);
    rows
}

#[cfg(test)]
mod tests {
    use super::rows_set;

    #[test]
    fn rows_set_lists_the_positive_entries_in_order() {
        assert_eq!(rows_set(&[0.0, 2.0, 0.0, 1.0, 1.0]), vec![1, 3, 4]);
        assert_eq!(rows_set(&[0.0; 4]), Vec::<i64>::new());
        assert_eq!(rows_set(&[]), Vec::<i64>::new());
        assert_eq!(rows_set(&[3.0, 1.0]), vec![0, 1]);
    }
}
