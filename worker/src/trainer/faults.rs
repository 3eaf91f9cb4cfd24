//! The fault-injection hooks the tests set through the environment (`GPTREC_FAULT_*`): a slow,
//! a stopped or a dead rank, and a preemption of the launcher. Reads them; the trainer acts.

use std::time::Duration;

use super::{task, TrainError};

/// The fault-injection hooks the tests set for this rank (`GPTREC_FAULT_SLOW`, `_STOP`, `_DIE`).
pub(super) struct Faults {
    pub(super) slow: Option<Duration>,
    pub(super) stop_before: Option<u64>,
    pub(super) die_before: Option<u64>,
    /// `GPTREC_FAULT_TERM_LAUNCH=STEP`: rank 0 sends SIGTERM to its parent (`launch`) after
    /// that step, as a preemption would, and waits (at most 10 s) until launch has passed it on.
    pub(super) term_launch_at: Option<u64>,
}

impl Faults {
    pub(super) fn from_env(rank: usize) -> Result<Faults, TrainError> {
        let var = |name: &str| std::env::var(name).unwrap_or_default();
        let slow = task::slow_fault(&var("GPTREC_FAULT_SLOW"), rank).map_err(TrainError::Plan)?;
        let stop_before =
            task::stop_fault(&var("GPTREC_FAULT_STOP"), rank).map_err(TrainError::Plan)?;
        let die_before = task::stop_fault(&var("GPTREC_FAULT_DIE"), rank)
            .map_err(|e| TrainError::Plan(e.replace("GPTREC_FAULT_STOP", "GPTREC_FAULT_DIE")))?;
        let term = var("GPTREC_FAULT_TERM_LAUNCH");
        let term_launch_at = match term.trim() {
            "" => None,
            text => Some(text.parse::<u64>().map_err(|_| {
                TrainError::Plan(format!(
                    "GPTREC_FAULT_TERM_LAUNCH={text:?}: expected a step number"
                ))
            })?),
        }
        .filter(|_| rank == 0);
        Ok(Faults {
            slow,
            stop_before,
            die_before,
            term_launch_at,
        })
    }
}

/// `GPTREC_FAULT_SLOW_START=MS[@RANK]`: how long `rank` sleeps before the rendezvous (every rank
/// when no rank is named), a rank 0 that is slow to serve the store for tests. `None` when unset
/// or for another rank.
pub fn slow_start_fault(rank: usize) -> Result<Option<Duration>, String> {
    let text = std::env::var("GPTREC_FAULT_SLOW_START").unwrap_or_default();
    task::slow_fault(&text, rank)
        .map_err(|e| e.replace("GPTREC_FAULT_SLOW", "GPTREC_FAULT_SLOW_START"))
}
