//! A loaded checkpoint's values are numbers: a tensor holding NaN or an infinity is refused,
//! named. Must not: read files (the caller has) or judge anything but finiteness.

use std::path::Path;

use super::{CheckpointError, NamedTensors};

/// Refuses the first floating-point tensor of `named` (read from `path`) with a value that is
/// not finite.
pub(super) fn all_finite(path: &Path, named: &NamedTensors) -> Result<(), CheckpointError> {
    let tensors = |source| CheckpointError::Tensors {
        path: path.display().to_string(),
        source,
    };
    for (name, t) in named {
        if !t.is_floating_point() || t.numel() == 0 {
            continue;
        }
        let bad = t
            .f_isfinite()
            .and_then(|f| f.f_logical_not())
            .and_then(|b| b.f_sum(tch::Kind::Int64));
        let bad = bad.and_then(|n| n.f_int64_value(&[])).map_err(tensors)?;
        if bad > 0 {
            return Err(CheckpointError::Invalid {
                path: path.display().to_string(),
                detail: format!(
                    "{name} holds {bad} of its {} values that are not finite (NaN or infinite): a diverged run or an edited file; resume from an earlier checkpoint",
                    t.numel()
                ),
            });
        }
    }
    Ok(())
}
