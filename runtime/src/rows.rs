//! Listed rows of a 2-D table (an embedding table's gradient): gathering them into one flat
//! tensor, writing them back, zeroing them, scaling them. A row-sparse step touches a few hundred
//! rows; done with tensor ops (`index_select`, `index_copy_`, ...) each of those costs more in
//! dispatch than in copying, so a contiguous f32 CPU table is handled with plain loops, and
//! anything else (a GPU, another dtype) with the tensor ops. Both give the same bits: rows are
//! copied, not computed, and a scaling is the same f32 multiply either way.
//!
//! Must not: know why the rows were chosen or talk to other ranks. Rows are ascending, without
//! duplicates, inside the table (the caller's contract; checked, as an error).

use tch::{Device, Kind, Tensor};

/// The table's contiguous f32 CPU buffer and its row width, or `None` when it is not one.
fn cpu_rows(table: &Tensor) -> Option<(*mut f32, usize, usize)> {
    let fits = table.device() == Device::Cpu
        && table.kind() == Kind::Float
        && table.dim() == 2
        && table.is_contiguous();
    let (rows, width) = (table.size()[0], table.size()[1]);
    fits.then(|| (table.data_ptr() as *mut f32, rows as usize, width as usize))
}

fn check(rows: &[i64], n: usize) -> Result<(), tch::TchError> {
    match rows.iter().find(|&&r| r < 0 || r as usize >= n) {
        Some(r) => Err(tch::TchError::Torch(format!(
            "row {r} is outside a table of {n} rows"
        ))),
        None => Ok(()),
    }
}

/// The rows of `table`, one after another, as a new 1-D tensor on the table's device.
pub fn gather(table: &Tensor, rows: &[i64]) -> Result<Tensor, tch::TchError> {
    let Some((base, n, width)) = cpu_rows(table) else {
        let index = Tensor::from_slice(rows).f_to_device(table.device())?;
        return table.f_index_select(0, &index)?.f_flatten(0, -1);
    };
    check(rows, n)?;
    let out = Tensor::f_empty([(rows.len() * width) as i64], (Kind::Float, Device::Cpu))?;
    // SAFETY: `table` is a contiguous f32 CPU buffer of n * width elements and `out` a fresh
    // one of rows.len() * width; both stay alive and untouched by others for this call (the
    // step runs on the training thread, under no_grad).
    let (src, dst) = unsafe {
        (
            std::slice::from_raw_parts(base as *const f32, n * width),
            std::slice::from_raw_parts_mut(out.data_ptr() as *mut f32, rows.len() * width),
        )
    };
    for (&r, to) in rows.iter().zip(dst.chunks_exact_mut(width.max(1))) {
        let r = r as usize;
        to.copy_from_slice(&src[r * width..(r + 1) * width]);
    }
    Ok(out)
}

/// Writes `values` (what [`gather`] gives: the rows one after another) into `rows` of `table`.
pub fn scatter(table: &Tensor, rows: &[i64], values: &Tensor) -> Result<(), tch::TchError> {
    let Some((base, n, width)) = cpu_rows(table) else {
        let index = Tensor::from_slice(rows).f_to_device(table.device())?;
        let width = table.size()[1];
        let _ = table
            .shallow_clone()
            .f_index_copy_(0, &index, &values.f_view([-1, width])?)?;
        return Ok(());
    };
    check(rows, n)?;
    let values = values.f_to_kind(Kind::Float)?.f_contiguous()?;
    if values.numel() != rows.len() * width {
        return Err(tch::TchError::Torch(format!(
            "{} values for {} rows of width {width}",
            values.numel(),
            rows.len()
        )));
    }
    // SAFETY: as in `gather`; `values` is a separate buffer of rows.len() * width elements.
    let (dst, src) = unsafe {
        (
            std::slice::from_raw_parts_mut(base, n * width),
            std::slice::from_raw_parts(values.data_ptr() as *const f32, rows.len() * width),
        )
    };
    for (&r, from) in rows.iter().zip(src.chunks_exact(width.max(1))) {
        let r = r as usize;
        dst[r * width..(r + 1) * width].copy_from_slice(from);
    }
    Ok(())
}

/// Sets `rows` of `table` to zero.
pub fn zero(table: &Tensor, rows: &[i64]) -> Result<(), tch::TchError> {
    scale_or_zero(table, rows, None)
}

/// Multiplies `rows` of `table` by `factor` (as `mul_(factor)` does: in f32 for an f32 table).
pub fn scale(table: &Tensor, rows: &[i64], factor: f64) -> Result<(), tch::TchError> {
    scale_or_zero(table, rows, Some(factor))
}

fn scale_or_zero(table: &Tensor, rows: &[i64], factor: Option<f64>) -> Result<(), tch::TchError> {
    let Some((base, n, width)) = cpu_rows(table) else {
        let index = Tensor::from_slice(rows).f_to_device(table.device())?;
        let mut table = table.shallow_clone();
        let _ = match factor {
            None => table.f_index_fill_(0, &index, 0.0)?,
            Some(f) => {
                let scaled = table.f_index_select(0, &index)?.f_mul_scalar(f)?;
                table.f_index_copy_(0, &index, &scaled)?
            }
        };
        return Ok(());
    };
    check(rows, n)?;
    // SAFETY: as in `gather`.
    let values = unsafe { std::slice::from_raw_parts_mut(base, n * width) };
    for &r in rows {
        let row = &mut values[r as usize * width..(r as usize + 1) * width];
        match factor {
            None => row.fill(0.0),
            Some(f) => {
                let f = f as f32;
                row.iter_mut().for_each(|x| *x *= f);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Tensor {
        tch::manual_seed(3);
        Tensor::randn([40, 6], (Kind::Float, Device::Cpu))
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        Vec::<f32>::try_from(t.flatten(0, -1))
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    const ROWS: [i64; 4] = [0, 5, 17, 39];

    /// The loops give the tensor ops' bits; a strided (non-contiguous) table takes the tensor
    /// ops' path and agrees too.
    #[test]
    fn loops_equal_tensor_ops() {
        let index = Tensor::from_slice(&ROWS);
        for t in [table(), table().tr().contiguous().tr()] {
            let want = t.index_select(0, &index).flatten(0, -1);
            assert_eq!(bits(&gather(&t, &ROWS).unwrap()), bits(&want));

            let values = Tensor::randn([24], (Kind::Float, Device::Cpu));
            let (got, expected) = (t.copy(), t.copy());
            scatter(&got, &ROWS, &values).unwrap();
            let _ = expected
                .shallow_clone()
                .index_copy_(0, &index, &values.view([-1, 6]));
            assert_eq!(bits(&got), bits(&expected));

            let (got, expected) = (t.copy(), t.copy());
            zero(&got, &ROWS).unwrap();
            let _ = expected.shallow_clone().index_fill_(0, &index, 0.0);
            assert_eq!(bits(&got), bits(&expected));

            // Scaling listed rows is the whole table's `mul_` on those rows.
            let (got, whole) = (t.copy(), t.copy());
            scale(&got, &ROWS, 0.3127).unwrap();
            let _ = whole.shallow_clone().g_mul_scalar_(0.3127);
            let want = t.copy();
            let _ = want
                .shallow_clone()
                .index_copy_(0, &index, &whole.index_select(0, &index));
            assert_eq!(bits(&got), bits(&want));
        }
    }

    #[test]
    fn a_row_outside_the_table_is_an_error() {
        let t = table();
        for bad in [[40i64], [-1]] {
            let e = gather(&t, &bad).unwrap_err().to_string();
            assert!(e.contains("outside a table of 40 rows"), "{e}");
            assert!(zero(&t, &bad).is_err());
            let values = Tensor::zeros([6], (Kind::Float, Device::Cpu));
            assert!(scatter(&t, &bad, &values).is_err());
        }
        let short = Tensor::zeros([5], (Kind::Float, Device::Cpu));
        let e = scatter(&t, &[1], &short).unwrap_err().to_string();
        assert!(e.contains("5 values for 1 rows of width 6"), "{e}");
    }
}
