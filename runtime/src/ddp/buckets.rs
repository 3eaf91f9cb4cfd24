//! The engine's gradient buckets: which dense parameters are reduced together, in which
//! order. By size, as PyTorch's DDP does, or one per unit of a model that declares them
//! ([`super::DdpConfig::units`]). Must not: reduce anything (the engine and ZeRO's layout do).

use tch::Tensor;

use super::DdpConfig;

/// The buckets of a model with units, and their unit names: one per unit of `config.units` that holds
/// dense parameters (`dense`, indices into `params`, named `names`), the last declared first
/// (the order in which backward completes them), then the other dense parameters in the usual
/// buckets, unnamed (each gathered for a whole window).
pub(super) fn unit_buckets(
    names: &[String],
    dense: &[usize],
    params: &[Tensor],
    config: &DdpConfig,
) -> (Vec<Vec<usize>>, Vec<Option<String>>) {
    let unit_of = |i: usize| (config.units.iter()).position(|u| names[i].starts_with(u.as_str()));
    let mut buckets = Vec::new();
    let mut labels = Vec::new();
    for (u, unit) in config.units.iter().enumerate().rev() {
        let members: Vec<usize> = (dense.iter().copied())
            .filter(|&i| unit_of(i) == Some(u))
            .collect();
        if !members.is_empty() {
            buckets.push(members);
            labels.push(Some(unit.clone()));
        }
    }
    let rest: Vec<usize> = (dense.iter().copied())
        .filter(|&i| unit_of(i).is_none())
        .collect();
    for bucket in make_buckets(params, &rest, config.bucket_bytes) {
        buckets.push(bucket);
        labels.push(None);
    }
    (buckets, labels)
}

/// Groups the parameters `which` (indices into `params`) into buckets of at most
/// `bucket_bytes` of f32 gradient, in reverse order (the order backward produces gradients, as
/// PyTorch's DDP does); a parameter larger than a bucket gets one of its own.
pub(super) fn make_buckets(
    params: &[Tensor],
    which: &[usize],
    bucket_bytes: usize,
) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut bytes = 0usize;
    for &i in which.iter().rev() {
        let size = params[i].numel() * 4;
        if !current.is_empty() && bytes + size > bucket_bytes {
            buckets.push(std::mem::take(&mut current));
            bytes = 0;
        }
        current.push(i);
        bytes += size;
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}
