//! Global-norm gradient clipping (as `torch.nn.utils.clip_grad_norm_`), over whole gradients or
//! over only the rows of a table's gradient that can be non-zero.
//!
//! Owns: the norm's arithmetic and the in-place scaling. The sum of squares of a contiguous f32
//! CPU gradient is taken row by row, each row in f64 with a fixed lane pattern and the rows
//! added in row order, so that skipping rows known to be zero gives the same bits as reading the
//! whole table (adding 0.0 is exact): the DDP engine's row-sparse path and its dense path clip
//! alike, while the sparse one reads a few hundred rows instead of whole embedding tables.
//!
//! Must not: talk to other ranks (the gradients arrive reduced) or know what the rows mean.

use tch::{Device, Kind, Tensor};

/// One gradient to clip: the whole of it (`rows: None`), or only `rows` of a gradient whose
/// other rows are zero (ascending, no duplicates).
pub struct ClipGrad<'a> {
    pub grad: Tensor,
    pub rows: Option<&'a [i64]>,
}

/// Global L2 norm over all defined gradients of `params`; if `max_norm / (norm + 1e-6) < 1` the
/// gradients are scaled in place by that factor. Returns the pre-clip norm (0 when no parameter
/// has a gradient). A non-finite norm leaves the gradients untouched and is returned as is, so
/// the caller can skip the step.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<f64, tch::TchError> {
    let grads: Vec<ClipGrad> = params
        .iter()
        .map(Tensor::grad)
        .filter(Tensor::defined)
        .map(|grad| ClipGrad { grad, rows: None })
        .collect();
    clip_grads(&grads, max_norm)
}

/// [`clip_grad_norm`] over `grads`, each whole or by its listed rows.
pub fn clip_grads(grads: &[ClipGrad<'_>], max_norm: f64) -> Result<f64, tch::TchError> {
    let _guard = tch::no_grad_guard();
    let mut sum = 0.0;
    // The norms of gradients on a device, kept there and read once together: a read per
    // gradient would be a host wait per gradient (about 150 a step for GPT-2).
    let mut on_device: Vec<Tensor> = Vec::new();
    for g in grads {
        match host_sum_of_squares(g)? {
            Some(s) => sum += s,
            None => on_device.push(device_norm(g)?),
        }
    }
    if !on_device.is_empty() {
        let norms = Tensor::f_stack(&on_device, 0)?;
        sum += crate::host_read::scalar(&norms.f_square()?.f_sum(Kind::Double)?)?;
    }
    let total = sum.sqrt();
    if !total.is_finite() {
        return Ok(total);
    }
    let coef = max_norm / (total + 1e-6);
    if coef < 1.0 {
        for g in grads {
            match &g.rows {
                None => {
                    let _ = g.grad.shallow_clone().f_mul_scalar_(coef)?;
                }
                // The same multiply as the whole tensor's, on the rows that are not zero.
                Some(rows) => crate::rows::scale(&g.grad, rows, coef)?,
            }
        }
    }
    Ok(total)
}

/// The L2 norm of `g`'s gradient (of its listed rows) as an f64 tensor where it lies (one
/// kernel, accumulated in f64).
fn device_norm(g: &ClipGrad<'_>) -> Result<Tensor, tch::TchError> {
    let picked = match &g.rows {
        Some(rows) => crate::rows::gather(&g.grad, rows)?,
        None => g.grad.shallow_clone(),
    };
    picked.f_norm_scalaropt_dtype(2.0, Kind::Double)
}

/// The sum of squares of `g`'s gradient (of its listed rows), in f64, computed here from the
/// values in place when it is a contiguous f32 CPU gradient (bit-exact whichever rows are
/// listed); `None` for any other (its norm is taken where it lies: [`device_norm`]).
fn host_sum_of_squares(g: &ClipGrad<'_>) -> Result<Option<f64>, tch::TchError> {
    let grad = &g.grad;
    let n = grad.numel();
    if n == 0 {
        return Ok(Some(0.0));
    }
    let cpu_f32 = grad.device() == Device::Cpu && grad.kind() == Kind::Float;
    if !cpu_f32 || !grad.is_contiguous() {
        return Ok(None);
    }
    let rows = if grad.dim() == 0 { 1 } else { grad.size()[0] };
    let width = n / rows as usize;
    // SAFETY: a contiguous f32 CPU buffer of n elements, alive and unchanged for this call
    // (clipping runs on the training thread, under no_grad).
    let values = unsafe { std::slice::from_raw_parts(grad.data_ptr() as *const f32, n) };
    let row = |r: usize| row_sum_of_squares(&values[r * width..(r + 1) * width]);
    add_rows(rows, g.rows, row).map(Some)
}

/// The sum of squares of one gradient (of its listed rows) in f64, as [`clip_grads`] adds it
/// up: from its rows where it is a contiguous f32 CPU gradient, else its norm where it lies,
/// squared (one read per call).
pub(crate) fn sum_of_squares(g: &ClipGrad<'_>) -> Result<f64, tch::TchError> {
    match host_sum_of_squares(g)? {
        Some(s) => Ok(s),
        None => crate::host_read::scalar(&device_norm(g)?.f_square()?),
    }
}

/// The sums of squares of `rows` of `values` seen as rows of `width` floats (a flattened
/// gradient, or a buffer of whole rows), in f64: [`row_sum_of_squares`] of each on a
/// contiguous f32 CPU tensor, so a row gives the bits it gives wherever it lies; elsewhere
/// [`device_row_sums`] and one read.
pub(crate) fn row_sums(
    values: &Tensor,
    width: usize,
    rows: std::ops::Range<i64>,
) -> Result<Vec<f64>, tch::TchError> {
    let count = (rows.end - rows.start).max(0);
    let needed = (rows.end.max(0) as usize) * width;
    if count == 0 || width == 0 {
        return Ok(vec![0.0; count as usize]);
    }
    if values.numel() < needed || values.dim() != 1 {
        return Err(tch::TchError::Torch(format!(
            "clipping: rows {rows:?} of width {width} outside {} values",
            values.numel()
        )));
    }
    let cpu_f32 = values.device() == Device::Cpu && values.kind() == Kind::Float;
    if cpu_f32 && values.is_contiguous() {
        // SAFETY: a contiguous f32 CPU buffer of at least `needed` elements, alive and
        // unchanged for this call (clipping runs on the training thread, under no_grad).
        let all = unsafe { std::slice::from_raw_parts(values.data_ptr() as *const f32, needed) };
        let row = |r: i64| row_sum_of_squares(&all[r as usize * width..(r as usize + 1) * width]);
        return Ok(rows.map(row).collect());
    }
    Vec::<f64>::try_from(device_row_sums(values, width, rows)?.f_to_device(Device::Cpu)?)
}

/// [`row_sums`] as an f64 tensor where `values` lie (one kernel, no read): for gradients on a
/// device, read together with others.
pub(crate) fn device_row_sums(
    values: &Tensor,
    width: usize,
    rows: std::ops::Range<i64>,
) -> Result<Tensor, tch::TchError> {
    let count = (rows.end - rows.start).max(0);
    if count == 0 || width == 0 {
        return Tensor::f_zeros([count], (Kind::Double, values.device()));
    }
    let block = values
        .f_narrow(0, rows.start * width as i64, count * width as i64)?
        .f_view([count, width as i64])?
        .f_to_kind(Kind::Double)?;
    block.f_square()?.f_sum_dim_intlist(1, false, Kind::Double)
}

/// A gradient's sum of squares from its rows' (`row(r)`, in f64): all `rows` of them in row
/// order, or the `listed` ones. The one place rows are added up, so that every path that
/// clips (whole gradients, listed rows, `ddp`'s sharded step from rows summed by several
/// ranks) gets the same bits.
pub(crate) fn add_rows(
    rows: i64,
    listed: Option<&[i64]>,
    row: impl Fn(usize) -> f64,
) -> Result<f64, tch::TchError> {
    Ok(match listed {
        None => (0..rows as usize).map(row).sum(),
        Some(listed) => {
            let mut total = 0.0;
            for &r in listed {
                if r < 0 || r >= rows {
                    return Err(tch::TchError::Torch(format!(
                        "clipping: row {r} is outside a gradient of {rows} rows"
                    )));
                }
                total += row(r as usize);
            }
            total
        }
    })
}

/// Eight f64 lanes, element `i` into lane `i % 8`, the lanes added in order: the same bits for a
/// row wherever it lies, and vectorised.
#[multiversion::multiversion(targets = "simd")]
pub(crate) fn row_sum_of_squares(row: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            let x = f64::from(x);
            *lane += x * x;
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(tail) {
        let x = f64::from(x);
        *lane += x * x;
    }
    lanes.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(values: &[f32]) -> Tensor {
        Tensor::from_slice(values).set_requires_grad(true)
    }

    fn set_grad(p: &Tensor, g: &[f32]) {
        let loss = (p * Tensor::from_slice(g)).sum(Kind::Float);
        loss.backward();
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
    }

    #[test]
    fn scales_to_max_and_returns_pre_clip_norm() {
        let a = param(&[0.0, 0.0]);
        let b = param(&[0.0]);
        let c = param(&[1.0]); // no grad: ignored
        set_grad(&a, &[3.0, 4.0]);
        set_grad(&b, &[12.0]);
        let params = [a.shallow_clone(), b.shallow_clone(), c.shallow_clone()];

        // Below the threshold: untouched.
        let norm = clip_grad_norm(&params, 100.0).unwrap();
        assert_eq!(norm, 13.0);
        assert_eq!(values(&a.grad()), vec![3.0, 4.0]);

        let norm = clip_grad_norm(&params, 6.5).unwrap();
        assert_eq!(norm, 13.0);
        let coef = (6.5 / (13.0 + 1e-6)) as f32;
        assert_eq!(values(&a.grad()), vec![3.0 * coef, 4.0 * coef]);
        assert_eq!(values(&b.grad()), vec![12.0 * coef]);
        let after = clip_grad_norm(&params, 1e9).unwrap();
        assert!((after - 6.5).abs() < 1e-5, "{after}");

        assert_eq!(clip_grad_norm(&[c.shallow_clone()], 1.0).unwrap(), 0.0);
    }

    #[test]
    fn leaves_non_finite_alone() {
        let a = param(&[0.0, 0.0]);
        set_grad(&a, &[f32::INFINITY, 1.0]);
        let norm = clip_grad_norm(&[a.shallow_clone()], 1.0).unwrap();
        assert!(norm.is_infinite());
        assert_eq!(values(&a.grad())[1], 1.0);
    }

    /// A table whose gradient is zero but for a few rows clips to the same bits whether the
    /// whole table or only those rows are read, and agrees with the f64 norm.
    #[test]
    fn listed_rows_clip_exactly_as_the_whole_table() {
        let table = || {
            let g = Tensor::zeros([50, 13], (Kind::Float, Device::Cpu));
            let rows = [2i64, 7, 31, 49];
            let vals = Tensor::randn([4, 13], (Kind::Float, Device::Cpu)) * 3.0;
            (
                g.index_copy(0, &Tensor::from_slice(&rows), &vals),
                rows.to_vec(),
            )
        };
        tch::manual_seed(5);
        let (g, rows) = table();
        let bias = Tensor::from_slice(&[0.5f32, -2.0]);
        let whole = [
            ClipGrad {
                grad: g.copy(),
                rows: None,
            },
            ClipGrad {
                grad: bias.copy(),
                rows: None,
            },
        ];
        let listed = [
            ClipGrad {
                grad: g.copy(),
                rows: Some(&rows),
            },
            ClipGrad {
                grad: bias.copy(),
                rows: None,
            },
        ];
        let a = clip_grads(&whole, 1.0).unwrap();
        let b = clip_grads(&listed, 1.0).unwrap();
        assert_eq!(a.to_bits(), b.to_bits());
        let exact = (g
            .to_kind(Kind::Double)
            .square()
            .sum(Kind::Double)
            .double_value(&[])
            + 4.25)
            .sqrt();
        assert!((a - exact).abs() < 1e-9 * exact, "{a} vs {exact}");
        assert!(a > 1.0, "the test must clip: {a}");
        for (w, l) in whole.iter().zip(&listed) {
            assert_eq!(values(&w.grad), values(&l.grad));
        }
        let bad = [ClipGrad {
            grad: g.copy(),
            rows: Some(&[50]),
        }];
        assert!(clip_grads(&bad, 1.0).is_err());
    }

    #[test]
    fn gradients_off_the_host_path_are_normed_where_they_lie_and_read_once() {
        // f64 gradients take the path of gradients on a GPU (their norms stay tensors): many
        // of them, one read, the same norm and clipping as the f32 gradients' host path.
        tch::manual_seed(11);
        let f32s: Vec<Tensor> = (0..40)
            .map(|i| Tensor::randn([3 + i % 5, 7], (Kind::Float, Device::Cpu)))
            .collect();
        let host: Vec<ClipGrad> = f32s
            .iter()
            .map(|g| ClipGrad {
                grad: g.copy(),
                rows: None,
            })
            .collect();
        let device: Vec<ClipGrad> = f32s
            .iter()
            .map(|g| ClipGrad {
                grad: g.to_kind(Kind::Double),
                rows: None,
            })
            .collect();
        let before = crate::host_read::reads();
        let b = clip_grads(&device, 1.0).unwrap();
        assert_eq!(crate::host_read::reads() - before, 1);
        let a = clip_grads(&host, 1.0).unwrap();
        assert!((a - b).abs() < 1e-12 * a, "{a} vs {b}");
        for (h, d) in host.iter().zip(&device) {
            let diff = (h.grad.to_kind(Kind::Double) - &d.grad)
                .abs()
                .max()
                .double_value(&[]);
            assert!(diff < 1e-6, "clipped gradients differ by {diff}");
        }
    }
}
