//! Reads of tensor values into the host during a training step, all through here so that they
//! can be counted. On a GPU each one is a host wait: the CPU stops queueing work until the
//! device has computed the value (and everything queued before it), so a step should make as
//! few as it can, and only for values it needs on the host (the step's summary, the norm it
//! logs). A test counts them per step ([`reads`]). Copies the other way, host data into a
//! step, go through [`to_device`], which does not wait either.
//!
//! Owns the counter, the reads and the copies in. Must not decide what is read: its callers do.

use std::cell::Cell;

use tch::{Kind, TchError, Tensor};

thread_local! {
    /// Reads made on this thread (the training loop runs on one thread).
    static READS: Cell<u64> = const { Cell::new(0) };
}

/// Reads made on this thread so far.
pub fn reads() -> u64 {
    READS.with(Cell::get)
}

fn count() {
    READS.with(|r| r.set(r.get() + 1));
}

/// The value of the one-element tensor `t`, as f64.
pub fn scalar(t: &Tensor) -> Result<f64, TchError> {
    count();
    t.f_double_value(&[])
}

/// Every value of `t` (any shape, any float kind), as f32, in order.
pub fn f32s(t: &Tensor) -> Result<Vec<f32>, TchError> {
    count();
    let flat = t.f_flatten(0, -1)?;
    let flat = if flat.kind() == Kind::Float {
        flat
    } else {
        flat.f_to_kind(Kind::Float)?
    };
    Vec::<f32>::try_from(&flat)
}

/// `t` on `device`: itself where it already is; from the host to a GPU staged in page-locked
/// memory and copied without waiting (a copy from ordinary memory makes the host wait for the
/// device's queue; libtorch's pinned-memory allocator keeps the staging buffer until the copy
/// is done), or copied plainly where memory cannot be pinned.
pub fn to_device(t: &Tensor, device: tch::Device) -> Tensor {
    if t.device() == device {
        return t.shallow_clone();
    }
    let pinned = (t.device() == tch::Device::Cpu).then(|| {
        t.f_pin_memory(device)
            .and_then(|p| p.f_to_device_(device, t.kind(), true, false))
    });
    match pinned {
        Some(Ok(copy)) => copy,
        _ => t.to_device(device),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_read_counts_once_on_its_thread() {
        let before = reads();
        let t = Tensor::from_slice(&[1.5f64, 2.0]);
        assert_eq!(scalar(&t.get(0)).unwrap(), 1.5);
        assert_eq!(f32s(&t).unwrap(), vec![1.5, 2.0]);
        assert_eq!(reads() - before, 2);
        // Another thread's reads are its own.
        std::thread::spawn(|| scalar(&Tensor::from(1.0f32)).unwrap())
            .join()
            .unwrap();
        assert_eq!(reads() - before, 2);
    }
}
